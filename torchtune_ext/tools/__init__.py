"""Commands around training: the bundled assets, GGUF conversion, a sharded checkpoint's export, the parity report.

* :mod:`~torchtune_ext.tools.download`: ``python -m torchtune_ext.download``, the bundled model and data;
* :mod:`~torchtune_ext.tools.gguf_to_hf`: a llama-architecture GGUF file as a Hugging Face folder;
* :mod:`~torchtune_ext.tools.export`: ``python -m torchtune_ext.checkpoint.export``, a sharded step as a HF folder;
* :mod:`~torchtune_ext.tools.parity_report`: ``python -m torchtune_ext.parity_report``.

Nothing is imported here.
"""
