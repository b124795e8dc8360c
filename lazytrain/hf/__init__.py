"""Hugging Face input and output: loading a model folder or a GGUF file (``model_loading``), the named models
fetched from the package registry (``named``), exporting a trained model as a Hugging Face folder (``export``)
and generating from it (``generate``).  Above the core (``ir``, ``frontend``, ``compiler``, ``runtime``)."""
