"""What converting, calibrating and evaluating all measure with, below all three: the evaluation
texts and their calibration/evaluation split (data), KL divergence from a reference (divergence),
teacher-forced and greedy scoring (scoring), and stock llama.cpp's decode timed alone
(llama_decode). Nothing here builds or converts a file."""
