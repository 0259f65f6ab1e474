"""The memorization study (docs/design.md section 8): does training make a model reproduce its
training documents verbatim, and does Goldfish loss prevent it -- measured with the controls the
AxoNN study's review asked for (a never-trained control bucket, every bucket's own epoch-0
baseline, Wilson intervals over documents, repeated seeds, the decoding stated).

Command line: ``python -m axo4d.memorization`` (:mod:`axo4d.memorization.__main__`). Library:

* :mod:`~axo4d.memorization.config`: the ``study.*`` settings (:class:`StudyConfig`);
* :mod:`~axo4d.memorization.documents`: documents, pool, buckets, and the treated documents as
  training batches (:class:`DocumentEpochs`);
* :mod:`~axo4d.memorization.protocol`: :func:`measure` (greedy continuation on the grid) and
  :class:`Study` (the starting model, every arm under every seed);
* :mod:`~axo4d.memorization.stats` and :mod:`~axo4d.memorization.report`: intervals and the report
  folder.
"""
