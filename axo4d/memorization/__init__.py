"""The memorization study (docs/design.md section 8): does training make a model reproduce its
training documents verbatim, and does Goldfish loss prevent it -- measured with the controls the
AxoNN study's review asked for (a never-trained control bucket, every bucket's own epoch-0
baseline, intervals over documents, repeated seeds, the decoding stated), with no study document
in anything else the model is trained on.

Command line: ``python -m axo4d.memorization`` (:mod:`axo4d.memorization.__main__`; ``render DIR``
remakes a report from its stored files). Library:

* :mod:`~axo4d.memorization.study_config`: the ``study.*`` settings (:class:`StudyConfig`);
* :mod:`~axo4d.memorization.documents`: documents, pool, rest, buckets, and the treated documents
  as training batches (:class:`DocumentEpochs`);
* :mod:`~axo4d.memorization.exclusion`: the study's documents kept out of the pool's other
  documents and of pre-training, by substring (rolling hashes of every window);
* :mod:`~axo4d.memorization.protocol`: :func:`measure` (greedy continuation on the grid) and
  :class:`Study` (the starting model, every arm under every seed);
* :mod:`~axo4d.memorization.stats`, :mod:`~axo4d.memorization.results` and
  :mod:`~axo4d.memorization.plots`: intervals over documents, the report folder and its plots.
"""
