"""The application layer: the ``lazytrain`` command (``cli``, its value types ``cli_types``), the training run
(``train``; its settings ``config``, its surroundings ``session``, its loop ``loop``, its files ``runfiles``), the
fine-tune of a user's model on a user's data (``finetune/``), and the launch of ranks (``launch``, ``ranks``,
``threads``).  It stands on every other layer and nothing imports it.  Inside it imports go one way:
cli -> train -> finetune/ -> loop, runfiles, session -> config -> cli_types."""
