"""The training application: GPT model (`model`), corpora (`data`), the loop (`loop`), comparisons
(`compare`), reports (`report`), checkpoints (`checkpoint`) and activation measurement (`measure`)."""
