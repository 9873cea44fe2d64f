"""Built-in reward functions: `math_answer` (final answers checked with math-verify, extra `math`)."""
