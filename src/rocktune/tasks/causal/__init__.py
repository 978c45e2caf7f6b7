"""The causal-LM kit every LM-based task imports (lm, dpo/orpo, grpo, vlm): the launch checks, the preflight, the
model building (kernels, compile, quantisation gate), the feed and its OOM split, the chunked loss, the fit of a run
to its memory (--auto), the samples, and the doctor's check of the whole path (``pathcheck.py``). No task lives
here: each task's own object is in its folder (``tasks/lm/task.py`` is supervised fine-tuning)."""
