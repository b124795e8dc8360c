"""The application layer: the ``lazytrain`` command (``cli``), the training run (``train``, ``loop``, ``runfiles``),
the fine-tune of a user's model on a user's data (``finetune/``), and the launch of ranks (``launch``, ``ranks``).
It stands on every other layer and nothing imports it."""
