"""`river-gguf generate` and `river-gguf chat`: text from river_gguf.Llama, the class the server
runs, so the same prompt, seed and settings give the same text in both."""
import json
import sys
from typing import Optional

from .._loader import native
from .common import UsageError, json_safe, load_llama, sampling_kwargs, stream_to_stdout, summary_line


# ----- generate ------------------------------------------------------------------------
def _read_prompt(args) -> str:
    if args.prompt is not None:
        return args.prompt
    if sys.stdin is None or sys.stdin.isatty():
        raise UsageError("no prompt: pass -p PROMPT or pipe it on stdin")
    text = sys.stdin.read()
    return text[:-1] if text.endswith("\n") else text  # `echo` adds one newline the user did not mean


def _cmd_generate(args) -> int:
    prompt = _read_prompt(args)
    llm = load_llama(args)
    kw = sampling_kwargs(args)
    if args.chat:
        msgs = ([{"role": "system", "content": args.system}] if args.system else [])
        msgs.append({"role": "user", "content": prompt})
        chunks = llm.create_chat_completion(msgs, stream=not args.json, **kw)
    else:
        chunks = llm.create_completion(prompt, stream=not args.json, **kw)
    if args.json:  # one JSON document on stdout: no streamed text mixed in
        ch = chunks["choices"][0]
        doc = {"text": ch["message"]["content"] if args.chat else ch["text"], "finish_reason": ch["finish_reason"],
               "usage": chunks["usage"], "stats": llm.last_stats}
        json.dump(json_safe(doc), sys.stdout)
    else:
        stream_to_stdout(chunks, args.chat)
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(summary_line(llm.last_stats, llm), file=sys.stderr)
    return 0


def register_generate(sub, common) -> None:
    p = sub.add_parser("generate", parents=[common.model, common.exit, common.sampling_gen],
                       help="generate text from a prompt, streaming it to stdout")
    p.add_argument("-p", "--prompt", default=None, help="prompt text (default: read stdin)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--json", action="store_true",
                   help="print the result (text, finish reason, usage, stats) as one JSON object instead")
    p.set_defaults(func=_cmd_generate)


# ----- chat ----------------------------------------------------------------------------
def _read_line(interactive: bool) -> Optional[str]:
    if interactive:
        try:
            return input("> ")  # input() gives line editing on a terminal
        except EOFError:
            return None
    line = sys.stdin.readline()
    return None if line == "" else line.rstrip("\n")


def _cmd_chat(args) -> int:
    ContextOverflowError = native.ContextOverflowError
    llm = load_llama(args)
    base = [{"role": "system", "content": args.system}] if args.system else []
    history = list(base)
    interactive = sys.stdin.isatty()
    kw = sampling_kwargs(args)
    while True:
        line = _read_line(interactive)
        if line is None or line.strip() in ("/exit", "/quit"):
            break
        if not line.strip():
            continue
        if line.strip() == "/reset":
            history = list(base)
            print("(history cleared)", file=sys.stderr)
            continue
        history.append({"role": "user", "content": line})
        try:
            chunks = llm.create_chat_completion(history, stream=True, **kw)
        except ContextOverflowError:
            # Drop the old turns and retry with this message alone; if even that does not fit, skip it.
            print(f"(context full at n_ctx={llm.n_ctx()}; history reset)", file=sys.stderr)
            history = base + [history[-1]]
            try:
                chunks = llm.create_chat_completion(history, stream=True, **kw)
            except ContextOverflowError:
                print("(message too long for the context; skipped)", file=sys.stderr)
                history = list(base)
                continue
        reply = stream_to_stdout(chunks, chat=True)
        sys.stdout.write("\n")
        sys.stdout.flush()
        history.append({"role": "assistant", "content": reply})
        print(summary_line(llm.last_stats, llm), file=sys.stderr)
    return 0


def register_chat(sub, common) -> None:
    p = sub.add_parser("chat", parents=[common.model, common.exit, common.sampling_chat],
                       help="interactive chat on stdin (/exit or EOF ends, /reset clears history)")
    p.add_argument("--system", default=None, help="system message")
    p.set_defaults(func=_cmd_chat)
