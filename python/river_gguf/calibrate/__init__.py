"""Work that measures a River GGUF and stores what it found in the file: re-choosing the presets
from speeds timed on the user's machine (`tune`)."""
