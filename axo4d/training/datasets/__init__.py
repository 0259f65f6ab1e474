"""Training data: sources of documents (the embedded corpus, text and JSONL files, Arrow and Parquet
tables), tokenizers, prepared folders (a token file and a document index), samples packed from
documents, their order over epochs and mixtures, and the samples of a step that each rank reads.
Owns everything between a file on disk and the ``(B, T)`` token ids a model sees; knows nothing
of models or optimizers.

Modules, bottom to top: ``tokenizer``, ``sources``, ``prepared``, ``order``, ``packing``,
``dataset`` (a run's dataset), ``batches`` (a step's samples).
"""
