"""Measuring River GGUFs: evaluation texts (data), the Pareto report against llama.cpp's static
quants (report), the `river-gguf eval` / `calibrate` commands (cli), the models evaluated beside the
default one (model_zoo) and llama.cpp's decode timed alone (llama_decode)."""
