"""Hugging Face interoperability: ``config.json`` to and from :class:`axo4d.config.ModelConfig`, the
tensor layout of each architecture, and safetensors folders read slice by slice (every rank only its
own pieces) and written one tensor at a time.
"""
