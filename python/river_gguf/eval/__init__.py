"""Measuring River GGUFs: evaluation texts (data), the Pareto report against llama.cpp's static
quants (report), the models evaluated beside the default one (model_zoo) and llama.cpp's decode
timed alone (llama_decode). The `river-gguf eval` / `calibrate` commands are river_gguf.cli.evaluate."""
