"""The fine-tuning stage: codebooks trained against the full-precision output distribution, with
its recipe, teacher-output cache, activation-checkpointing policy and resumable epoch state.
"""
