"""The OpenAI Batch and Files APIs: input lines, the batches' state machine, their Redis records, the handlers."""
