"""Training data: token sources (the embedded corpus, text and JSONL documents, token files),
tokenizers, and the rows of a step's batch that each rank reads. Owns everything between a file on
disk and the ``(B, T)`` token ids a model sees; knows nothing of models or optimizers.
"""
