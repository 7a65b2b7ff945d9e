"""The chat side of river_gguf.Llama: llama_cpp's chat handlers for the file's templates (rendered
in chat.py's sandbox) and the choice of chat_format as llama_cpp makes it, response_format's
OpenAI JSON-schema form turned into a grammar, and the view of a Llama a handler gets for one call
with River options."""
import json
from typing import Any, Dict, Optional, Tuple

import llama_cpp.llama_chat_format as llama_chat_format
from llama_cpp.llama_grammar import LlamaGrammar

from .chat import template_chat_handler


def chat_handlers(vocab_model, metadata: Dict[str, str], eos_id: int, bos_id: int, chat_format: Optional[str],
                  chat_handler) -> Tuple[Dict[str, Any], Optional[str]]:
    """llama_cpp's choice: a handler per chat template in the metadata (by name), and the
    chat_format: the one given, else guessed from the default template, else that template
    itself, else "llama-2" (None when a chat_handler is given instead). vocab_model: the
    vocab-only libllama model (the special tokens' text)."""
    eos_token = vocab_model.token_get_text(eos_id) if eos_id != -1 else ""
    bos_token = vocab_model.token_get_text(bos_id) if bos_id != -1 else ""
    templates = {name[len("tokenizer."):]: t for name, t in metadata.items()
                 if name.startswith("tokenizer.chat_template.")}
    if "tokenizer.chat_template" in metadata:
        templates["chat_template.default"] = metadata["tokenizer.chat_template"]
    # llama_cpp's Jinja2ChatFormatter, rendered within chat.py's limits: templates come from
    # downloaded files.
    handlers = {name: template_chat_handler(template, eos_token, bos_token, [eos_id])
                for name, template in templates.items()}
    if chat_format is None and chat_handler is None and "chat_template.default" in templates:
        chat_format = llama_chat_format.guess_chat_format_from_gguf_metadata(metadata) or "chat_template.default"
    if chat_format is None and chat_handler is None:
        chat_format = "llama-2"
    return handlers, chat_format


def schema_grammar(response_format, grammar, verbose: bool):
    """(response_format, grammar) for llama_cpp's handler: {"type": "json_schema", "json_schema":
    {"schema": {...}}} (the OpenAI form, which llama_cpp 0.3.36 ignores) becomes a grammar
    (llama_cpp.llama_grammar.json_schema_to_gbnf) unless one is given, and no response_format;
    {"type": "json_object"} and None pass as they are; anything else raises ValueError."""
    if isinstance(response_format, dict) and response_format.get("type") == "json_schema":
        spec = response_format.get("json_schema") or {}
        schema = spec.get("schema", response_format.get("schema")) if isinstance(spec, dict) else None
        if schema is None:
            raise ValueError('response_format {"type": "json_schema"} needs a schema: '
                             '{"type": "json_schema", "json_schema": {"schema": {...}}}')
        if grammar is None:
            grammar = LlamaGrammar.from_json_schema(json.dumps(schema), verbose=verbose)
        return None, grammar
    if response_format is not None and (not isinstance(response_format, dict) or "type" not in response_format):
        raise ValueError(f'response_format must be a dict with a "type", got {response_format!r}')
    return response_format, grammar


def as_openai_v1(response, stream: bool):
    """A chat completion's dict (or a stream's chunk dicts) as openai.types.chat objects."""
    try:  # the openai package is optional: only this conversion needs it
        from openai.types.chat import ChatCompletion, ChatCompletionChunk
    except ImportError:
        raise ImportError("To use create_chat_completion_openai_v1, you must install the openai package. "
                          "You can install it with `pip install openai`.") from None
    if stream:
        return (ChatCompletionChunk(**chunk) for chunk in response)
    return ChatCompletion(**response)


class WithRiverOptions:
    """A Llama seen by llama_cpp's chat handler for one call: the handler calls create_completion
    with its own arguments, and the call's River options go down with them. Everything else is
    the Llama's."""

    def __init__(self, llama, river_options: Dict[str, Any]):
        self._llama = llama
        self._river_options = river_options

    def create_completion(self, *args, **kwargs):
        return self._llama.create_completion(*args, **kwargs, **self._river_options)

    def __call__(self, *args, **kwargs):
        return self._llama(*args, **kwargs, **self._river_options)

    def __getattr__(self, name: str):
        return getattr(self._llama, name)
