"""What the command line decides about the server (not about the model)."""
import os
from dataclasses import dataclass
from typing import Optional

#: Environment variable read when --api-key is not given.
API_KEY_ENV = "RIVER_GGUF_API_KEY"
DEFAULT_HOST = "127.0.0.1"  # localhost only unless the user asks for more
DEFAULT_PORT = 8000


@dataclass(frozen=True)
class ServerSettings:
    model_id: str                   # the name /v1/models lists and responses carry
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_key: Optional[str] = None   # None: no authentication

    def __post_init__(self):
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ValueError(f"model id must be a non-empty str, got {self.model_id!r}")
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host must be a non-empty str, got {self.host!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be an int in [0, 65535], got {self.port!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key.strip()):
            raise ValueError("the API key must be a non-empty string")

    @property
    def is_local(self) -> bool:
        return self.host in ("127.0.0.1", "localhost", "::1")


def api_key_from(arg: Optional[str]) -> Optional[str]:
    """--api-key if given, else $RIVER_GGUF_API_KEY, else None (an empty variable counts as unset)."""
    if arg is not None:
        return arg
    return os.environ.get(API_KEY_ENV) or None
