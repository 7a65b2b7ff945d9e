"""`river-gguf serve`: an OpenAI-compatible HTTP server for one model, on llama-server's slots.

    river-gguf serve MODEL.gguf --port 8000 [--parallel N]

Endpoints: POST /v1/completions, POST /v1/chat/completions (stream=true answers with
server-sent events), GET /v1/models, GET /health, GET /slots, POST /extras/tokenize[/count].

Modules, one job each (the subcommand itself is river_gguf.cli.serve_cmd): settings (what the
command line decides), served_model (which model class serves, how its slots are made and sized),
protocol (what the server needs of a model), schemas (request bodies), params (request -> model
keyword arguments), errors (OpenAI-style error bodies), auth (the optional API key), worker (the
slots: a request on a free one, or waiting in arrival order), sse (streaming responses), app
(the ASGI app) and loading (llama-server's 503 while the model loads).

The web stack is imported when the command runs, so `river-gguf` works without the `server`
extra installed.
"""
