"""Reading and writing GGUF files: atomic output, metadata copies and llama.cpp's quantizer (io),
River metadata rewrites (meta), the River index of a river's tensors (river_index), and the
tensor-by-tensor copy the converter and the hybrid writer share (copy). Below everything that
makes or reads a River GGUF; `import gguf` inside it is gguf-py."""
