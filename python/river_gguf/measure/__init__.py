"""What converting, calibrating and evaluating all measure with, below all three: the evaluation
texts and their calibration/evaluation split (data), KL divergence from a reference (divergence),
teacher-forced scoring (teacher), the exit rule's traces (traces) and its profile, the default
tau (profile), river tails (tails), greedy
scoring over items (scoring), and stock llama.cpp's decode timed alone (llama_decode). Each is a
policy on a Model's Session or one of its narrow calibration passes. Nothing here builds or
converts a file."""
