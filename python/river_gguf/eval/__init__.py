"""Measuring River GGUFs: the Pareto report against llama.cpp's static quants (report, rendered by
render), task accuracy in a sandbox (tasks), the models evaluated beside the default one
(model_zoo) and random-weight models of any family and shape (random_model). The evaluation texts
and llama.cpp's decode timed alone are in river_gguf.measure; the `river-gguf eval` / `calibrate`
commands are river_gguf.cli.evaluate."""
