"""The settings of a ``lazytrain train`` run, typed, each with what the rest of the application needs to know about
it: its command-line flag (name, help, value type, choices), whether a resumed run keeps it, whether
``metrics.json`` records it.  ``TrainConfig`` is a run on the built-in task, ``FinetuneConfig`` one on a data file
(``--data``).

Everything about a setting is written once, here: ``cli.py`` makes the ``lazytrain train`` flags from these fields
(``Setting``); ``runfiles.py`` and ``finetune/run.py`` take the settings a resume keeps from ``resumed`` (and
``runfiles.py`` checks their JSON with ``resumed_shapes``); both runs write ``metrics.json``'s settings with
``recorded``; a test checks the README's flag list and ``--help`` against them.  A new setting that reaches the
compiler is a field here, its use where the plan is compiled (``loop.py``'s ``_shared_plan``) and its flag in the
README's list.

``batch`` is the global batch everywhere: the rows one optimizer step sees, over all GPUs (``--gpus N`` runs
``batch / N`` rows a rank).  Sizes are bytes (``gpu_memory``, ``host_memory``); the compile's named choices are the
enums of ``compiler/options.py``.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from ..compiler.options import Optimizer, Policy
from ..ir.limits import MAX_BATCH, MAX_SEQ_LEN
from ..util.jsonshape import Either, Int, ListOf, MapOf, Num, OneOf, Opt
from . import cli_types


class Runs(enum.Flag):
    """Which runs a property of a setting holds for: the built-in task's, a data file's (``--data``), both."""
    NONE = 0
    TASK = enum.auto()
    DATA = enum.auto()
    ALL = TASK | DATA


@dataclass(frozen=True)
class Setting:
    """What is known about one setting besides its value.  ``help`` None: no flag (Python API only); it is a
    ``str.format`` template that may name ``d`` (``TrainConfig()``), ``f`` (``FinetuneConfig()``) and the
    names ``cli.py`` passes (``presets``, ``difficulties``, ``formats``)."""

    help: str | None = None
    type: Callable[[str], Any] | None = None
    #: the accepted values, or a function that returns them (imports what the parser alone should not load)
    choices: tuple[str, ...] | Callable[[], tuple[str, ...]] | None = None
    metavar: str | None = None
    #: the flag when it is not ``--`` and the field's name with dashes (``--answer-only-loss``)
    flag: str | None = None
    #: a flag without a value that sets the field to this (``--no-eval``: False)
    const: Any = None
    nargs: str | None = None
    #: "train" (the flags of a run) or "data" (fine-tune on a file; a group of its own in ``--help``)
    group: str = "train"
    #: runs that keep the value of the run they resume (a flag asking for another is an error)
    resumed: Runs = Runs.NONE
    #: runs whose resume takes the value the run recorded when the flag is not given; a flag given changes it, and
    #: the resume says so.  A setting neither resumed nor carried is about this command alone (the machine, where to
    #: write): a resume takes it from the command line
    carried: Runs = Runs.NONE
    #: runs whose ``metrics.json`` records it under ``settings``
    recorded: Runs = Runs.ALL
    #: its value's shape in ``metrics.json`` (``util/jsonshape.py``), checked where a resumed task run reads it
    shape: object = None
    #: its key in a config file (``lazytrain train CONFIG.yaml``) when not the field's name: Hugging Face
    #: ``TrainingArguments`` / TRL ``SFTConfig``'s name where they have one (``learning_rate`` for ``lr``)
    key: str | None = None

    def flag_name(self, name: str) -> str:
        return self.flag or "--" + name.replace("_", "-")

    def key_name(self, name: str) -> str:
        """The setting's config-file key."""
        return self.key or name


def setting(default, help: str | None = None, *, default_factory=None, **kw) -> Any:
    """A dataclass field with its ``Setting``."""
    meta = {"setting": Setting(help, **kw)}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def redefault(cls, name: str, default) -> Any:
    """``cls``'s field ``name`` with another default (a subclass's), its ``Setting`` kept."""
    return field(default=default, metadata=cls.__dataclass_fields__[name].metadata)


def setting_of(f) -> Setting:
    """The ``Setting`` of a dataclass field (an empty one for a field without)."""
    return f.metadata.get("setting", Setting())


def _schedules() -> tuple[str, ...]:
    return _SCHEDULES


def _loss_on() -> tuple[str, ...]:
    from ..data.encode import LOSS_ON  # data/ imports torch: only when the flags are made
    return tuple(LOSS_ON)


_KEPT = Runs.ALL
#: ``loop.SCHEDULES`` (loop.py imports torch: the parser does not)
_SCHEDULES = ("cosine", "linear", "constant_with_warmup", "constant")
_SIZE = Either(None, str, Int(1))            # bytes (a size string where the Python API was given one)
UNIT = math.nextafter(1.0, 2.0)             # exclusive bound that admits 1.0
_MODEL_HELP = ("the model to train. With --data, a pretrained one: smollm2-135m-instruct (SmolLM2-135M-Instruct, "
               "fetched once), a local Hugging Face folder (config.json, *.safetensors, tokenizer files) or a .gguf "
               "file. On the built-in task: 'task' (a small GPT sized for it, default). Either: a preset ({presets}: "
               "random init), a config.json (random init), or package.module:factory (imports and calls it: runs "
               "code, so name only code you trust)")
#: the host optimizers a run may use: the Hybrid 8-bit AdamW, with its exact master or the stochastic-rounding one,
#: with 8-bit or 4-bit moments
OPTIMIZERS = tuple(o.value for o in (Optimizer.HYBRID8BIT, Optimizer.HYBRID8BIT_SR, Optimizer.HYBRID4BIT,
                                     Optimizer.HYBRID4BIT_SR))
_RESIDENT_HELP = ("keep blocks on the GPU for the whole run (parameters, optimizer state, gradients; their update runs "
                  "on the GPU): auto lets the compiler choose how many of the first blocks (milp policy, on a GPU), "
                  "N keeps the first N (tied groups whole) (default {d.resident})")


@dataclass
class TrainConfig:
    """A ``lazytrain train`` run on the built-in arithmetic task (``train.py``)."""

    model: str = setting("task", _MODEL_HELP, type=cli_types.path, metavar="M", resumed=_KEPT, shape=str,
                         key="model_name_or_path")
    difficulty: str = setting(
        "tiny-pad-carry",    # the answer format a small GPT learns fastest (README "Train")
        "arithmetic task preset ({difficulties}; default {d.difficulty}), optionally with answer formats after it, "
        "e.g. tiny-pad-rev ({formats}: tasks/formats.py)", type=cli_types.difficulty, metavar="NAME",
        resumed=Runs.TASK, recorded=Runs.TASK, shape=str)
    batch: int = setting(32, "global batch size: the rows one optimizer step sees, over all GPUs; the plan splits it "
                             "into micro-batches itself (default {d.batch})",
                         type=cli_types.positive, metavar="N", resumed=_KEPT, shape=Int(1, MAX_BATCH + 1),
                         key="global_batch_size")
    seq: int | None = setting(None, "sequence length in tokens, at least the difficulty's longest example (default: "
                                    "that)", type=cli_types.positive, metavar="N", resumed=_KEPT,
                               shape=Int(1, MAX_SEQ_LEN + 1), key="max_seq_length")
    steps: int | None = setting(   # more than 9 min allow on 2 CPU cores: the time limit ends the run
        6000, "optimizer steps in all, counting those of a --resume'd run (default {d.steps}; with --data: --epochs; "
              "--time-limit-min may stop it sooner)", type=cli_types.positive, metavar="N", carried=_KEPT,
        shape=Either(None, Int(1)), key="max_steps")
    lr: float = setting(3e-3, "peak learning rate (default {d.lr}; with --data {f.lr})", type=cli_types.positive_float,
                        carried=_KEPT, shape=Num(), key="learning_rate")
    warmup: int = setting(50, "warm-up steps, at most half the steps the run makes (default {d.warmup}; with --data "
                              "{f.warmup})", type=cli_types.non_negative, metavar="N", resumed=_KEPT, shape=int,
                          key="warmup_steps")
    #: a run folder written before these schedule settings existed has none: it resumes with the defaults (``Opt``)
    warmup_ratio: float | None = setting(
        None, "warm-up as a share of the steps the run makes, instead of --warmup (with a time limit, of the steps "
              "its measured pace allows)", type=cli_types.fraction, metavar="R", resumed=_KEPT,
        shape=Opt(Either(None, Num(0.0, UNIT))))
    lr_scheduler_type: str = setting(
        "cosine", "the learning rate after the warm-up: cosine or linear down to --min-lr-ratio x --lr at the last "
                  "step, constant_with_warmup; constant: no warm-up (default {d.lr_scheduler_type})",
        choices=_schedules, resumed=_KEPT, shape=Opt(OneOf(*_SCHEDULES)))
    min_lr_ratio: float = setting(0.1, "the learning rate the decay ends at, as a share of --lr (default "
                                       "{d.min_lr_ratio})", type=cli_types.fraction, metavar="R", resumed=_KEPT,
                                  shape=Num(0.0, UNIT))
    weight_decay: float = setting(0.0, "AdamW weight decay (default {d.weight_decay:g}; refused with frozen "
                                       "parameters)", type=cli_types.non_negative_float, metavar="W", resumed=_KEPT,
                                  shape=Num())
    max_grad_norm: float | None = setting(1.0, "clip the global gradient norm to this (exactly, over every block; "
                                               "default {d.max_grad_norm:g})", type=cli_types.positive_float,
                                          metavar="NORM", resumed=_KEPT, shape=Either(None, Num()))
    loss_on_prompt: bool = setting(
        True, "loss on the answer only (default: on every token; see lazytrain/app/train.py)",
        flag="--answer-only-loss", const=False, resumed=Runs.TASK, recorded=Runs.TASK, shape=bool)
    gpu_memory: int | None = setting(None, "GPU budget, e.g. 24GiB (default: the GPU's)", type=cli_types.size,
                                     metavar="SIZE", resumed=_KEPT, shape=_SIZE)      # bytes
    host_memory: int | None = setting(None, "host budget, e.g. 64GiB (default: the host's)", type=cli_types.size,
                                      metavar="SIZE", resumed=_KEPT, shape=_SIZE)     # bytes
    #: where state and activations that do not fit the host budget go; a resumed run may name another folder (its
    #: files are scratch, rebuilt from the checkpoint)
    nvme_dir: str | None = setting(None, "folder on a fast drive for the training state (optimizer state, gradients, "
                                         "parameters) and activations that do not fit the host budget (default: "
                                         "none)", type=cli_types.path, metavar="DIR")
    nvme_memory: int | None = setting(None, "NVMe budget with --nvme-dir, e.g. 1TiB (default: none)",
                                      type=cli_types.size, metavar="SIZE", resumed=_KEPT, shape=_SIZE)
    policy: Policy = setting(Policy.MILP, "how the plan is chosen: the MILP solver, or a fixed heuristic (default "
                                          "{d.policy})", choices=Policy.names, resumed=_KEPT,
                             shape=OneOf(*Policy.names()))
    #: a run folder written before this setting existed has none: it resumed with the default (``Opt``)
    optimizer: Optimizer = setting(
        Optimizer.HYBRID8BIT, "host optimizer: Hybrid 8-bit AdamW with its exact fp32 master (8.25 bytes a parameter "
                              "in host memory); hybrid8bit-sr, a bf16 master rounded stochastically (6.25 bytes); "
                              "hybrid4bit, 4-bit moments (7.25 bytes); hybrid4bit-sr, both (5.25 bytes).  All but "
                              "the first update on the host only, no GPU-resident blocks; their accuracy cost: "
                              "benchmarks/results/issue41_bytes_per_param (default {d.optimizer})",
        choices=OPTIMIZERS, resumed=_KEPT, shape=Opt(OneOf(*OPTIMIZERS)))
    #: blocks kept on the GPU (``compile_model``'s ``resident``): "auto", "none", the first N, or these indices
    resident: Literal["auto", "none"] | int | list[int] = setting(
        "auto", _RESIDENT_HELP, type=cli_types.resident, metavar="none|auto|N|i,j,..", resumed=_KEPT,
        shape=Either(OneOf("auto", "none"), int, ListOf(int)))
    #: LoRA adapters (``frontend/lora.py``'s mapping: r, alpha, targets, dropout); None: the whole model trains
    lora: dict | None = setting(
        None, "train LoRA adapters (PEFT) instead of the whole model: r=16,alpha=32,targets=q_proj,k_proj,v_proj,"
              "o_proj,gate_proj,up_proj,down_proj[,dropout=0] (targets=all-linear: those seven); the base streams "
              "frozen, without gradients or optimizer state, and checkpoints hold the adapters (needs the lora "
              "extra)", type=cli_types.lora, metavar="r=R,alpha=A,targets=M,..", resumed=_KEPT, group="data",
        shape=Opt(Either(None, {"r": Int(1), "alpha": Num(), "targets": ListOf(str), "dropout": Num()})))
    #: bits the frozen base is held in on the host and moved in (``runtime/quantized.py``): 16, 8 or 4 (with lora)
    base_bits: int = setting(16, "with --lora: bits the frozen base is held in on the host and moved to the GPU in "
                                 "(16: the parameter dtype; 8: block-wise int8; 4: NF4, QLoRA's), dequantized on the "
                                 "GPU before each block runs (8 and 4 need the qlora extra) (default {d.base_bits})",
                             type=int, choices=(16, 8, 4), resumed=_KEPT, group="data", shape=OneOf(16, 8, 4))
    eval_every: int = setting(0, "evaluate every N steps: exact match on 200 eval problems (with --data: on the "
                                 "held-out examples, with eval loss and sample replies); default: before (--data) "
                                 "and after training only", type=cli_types.non_negative, metavar="N", carried=_KEPT,
                              shape=Int(0), key="eval_steps")
    #: a data run's held-out examples are at most this many: it shapes the training set, so that run keeps it
    eval_size: int = setting(500, "held-out problems for the final exact match (default {d.eval_size}; with --data: "
                                  "at most this many eval examples, default {f.eval_size})",
                             type=cli_types.positive, metavar="N", resumed=Runs.DATA, carried=Runs.TASK,
                             shape=Int(1))
    evaluate: bool = setting(True, "no exact-match evaluation, during or after the run (throughput runs)",
                             flag="--no-eval", const=False, group="data", carried=_KEPT, shape=bool, key="do_eval")
    seed: int = setting(0, "model initialisation and data order, 0 to 2**63 - 1 (default {d.seed})",
                        type=cli_types.seed, resumed=_KEPT, shape=Int(0, 1 << 63))
    time_limit_min: float | None = setting(
        9.0, "minutes of training: the step loop, with its --eval-every evaluations; the steps it allows are "
             "estimated from the measured pace and the warm-up and decay planned in them. Loading, compiling, the "
             "evaluations before and after and the export come on top (the run prints each one's time); 0: no "
             "limit (default {d.time_limit_min:g})", type=cli_types.minutes, metavar="MIN", carried=_KEPT,
        shape=Either(None, Num()))
    output: str = setting("runs/train", "the run folder: metrics.json, loss.png, checkpoint/ (with --data also "
                                        "model/, the Hugging Face folder) (default {d.output})", type=cli_types.path,
                          metavar="DIR", key="output_dir")
    resume: str | None = setting(None, "continue the run saved in DIR (an --output folder) up to --steps, with its "
                                       "model, data, batch and plan; only data is read from DIR, no code runs",
                                 type=cli_types.path, metavar="DIR")
    #: periodic checkpoints (``saves.py``): ``OUTPUT/checkpoint-STEP/`` every N steps, the newest K kept
    save_steps: int = setting(0, "commit a complete checkpoint (with the metrics as of that step) to "
                                 "OUTPUT/checkpoint-STEP/ every N steps (default: only the final OUTPUT/checkpoint/)",
                              type=cli_types.non_negative, metavar="N", carried=_KEPT, shape=Opt(Int(0)))
    save_total_limit: int | None = setting(None, "keep only the newest K periodic checkpoints, deleting older ones "
                                                 "once a newer one is committed (default: keep all)",
                                           type=cli_types.positive, metavar="K", carried=_KEPT,
                                           shape=Opt(Either(None, Int(1))))
    resume_from_checkpoint: bool | str | None = setting(
        None, "resume from the newest complete checkpoint in --output (no PATH), in the run folder PATH, or from the "
              "checkpoint folder PATH (OUTPUT/checkpoint-STEP); --resume DIR also takes DIR's newest",
        type=cli_types.path, nargs="?", const=True, metavar="PATH")
    #: the checkpoint folder a resume reads, chosen when the run starts (``saves.pick``); None: DIR/checkpoint
    resumed_checkpoint: str | None = setting(None)
    device: str | None = setting(None, "default: cuda when there is a GPU", choices=("cpu", "cuda"))
    hardware: str | None = setting(None, "the hardware profile the plan is compiled for: a built-in one "
                                         "({profiles}) or a file from `lazytrain profile` (default: the profile of "
                                         "this GPU's name, cpu on the CPU)", type=cli_types.path, metavar="NAME|FILE")
    threads: int | None = setting(None, "CPU threads, at most the cores (default: measured, starting from the cores "
                                        "idle at the start)", type=cli_types.positive, metavar="N")
    progress: bool = setting(True, "no progress bar", flag="--no-progress", const=False, recorded=Runs.NONE)
    #: a resume logs to the trackers its run named unless the flag says otherwise (TensorBoard's curves continue);
    #: trackers.py says where each one writes.  A run folder older than these settings has none (``Opt``)
    report_to: list[str] = setting(
        None, "send the run's scalars, evaluations and settings to these trackers, comma-separated: tensorboard "
            "(OUTPUT/tensorboard/), wandb, mlflow (file:OUTPUT/mlruns unless MLFLOW_TRACKING_URI), or none (default); "
            "each needs its library (pip install tensorboard, wandb or mlflow-skinny)", default_factory=list,
        type=cli_types.report_to,
        metavar="T,..", key="report_to", carried=_KEPT, shape=Opt(ListOf(str)))
    logging_steps: int = setting(1, "with --report-to, write the scalars every N steps, the means over them "
                                    "(default {d.logging_steps}: every step, as metrics.json's loss curve)",
                                 type=cli_types.positive, metavar="N", key="logging_steps", carried=_KEPT,
                                 shape=Opt(Int(1)))
    run_name: str | None = setting(None, "the run's name in the trackers (default: --output)", metavar="NAME",
                                   key="run_name", carried=_KEPT, shape=Opt(Either(None, str)))
    profile: int | None = setting(
        None, "time every op of step STEP (default 5): print how much of each transfer kind and of the host update "
              "was hidden under compute; write profile.json, trace.json and memory.png", type=int, nargs="?",
        const=5, metavar="STEP")
    allow_factory: bool = setting(False, "let --resume import and call the package.module:factory the run recorded "
                                         "(code named in DIR: only for a run folder you trust)", const=True)
    overwrite: bool = setting(False, "replace the run already in --output (its checkpoint and metrics) by this new "
                                     "one; without it a run over another run's folder is refused", const=True,
                              recorded=Runs.NONE)
    #: model-config overrides for "task" (tests, examples)
    extra: dict = setting(None, default_factory=dict, recorded=Runs.TASK)
    #: the settings the command line gave (``cli.py``), which a resume tells from those left out (``asked``); None
    #: through the Python API
    given: frozenset[str] | None = field(default=None, compare=False, metadata={"setting": Setting(recorded=Runs.NONE)})

    @property
    def runs(self) -> Runs:
        """The kind of run this configures."""
        return Runs.TASK


@dataclass
class FinetuneConfig(TrainConfig):
    """``TrainConfig`` and what fine-tuning on a file adds (``finetune/``); defaults for a pretrained model."""

    data: str | None = setting(
        None, "train on this file: JSONL, JSON, parquet, CSV, TSV, Arrow or a datasets save_to_disk folder "
              "(messages, conversations, prompt/completion, alpaca or text records; see --columns) instead of the "
              "built-in task; --model then names a pretrained model: smollm2-135m-instruct, a Hugging "
              "Face folder or a GGUF file", type=cli_types.path, metavar="FILE", group="data", resumed=Runs.DATA,
        key="train_file")
    eval_data: str | None = setting(None, "evaluate on this file (default: 5%% of --data held out, by a hash of each "
                                          "example)", type=cli_types.path, metavar="FILE", group="data",
                                    resumed=Runs.DATA, key="validation_file")
    columns: dict | None = setting(None, "rename the file's columns (keys) to the keys we read, e.g. "
                                         "question=prompt,answer=completion (in a config file, a mapping)",
                                   type=cli_types.columns, metavar="COL=KEY,...", group="data", resumed=Runs.DATA,
                                   shape=Either(None, MapOf(str)))
    text_field: str | None = setting(None, "the column (key) holding plain text to train on: --columns COLUMN=text "
                                           "(TRL's dataset_text_field)", metavar="COLUMN", group="data",
                                     resumed=Runs.DATA, shape=Either(None, str), key="dataset_text_field")
    system_prompt: str | None = setting(None, "a system turn put first in every chat that has none; '' for none "
                                              "(the chat template's default left out where it allows)", metavar="TEXT",
                                        group="data", resumed=Runs.DATA, shape=Either(None, str))
    chat_template: str | None = setting(None, "a Jinja chat template file replacing the tokenizer's (kept with the "
                                              "run's tokenizer)", type=cli_types.path, metavar="FILE", group="data",
                                        resumed=Runs.DATA, shape=Either(None, str))
    tokenizer: str | None = setting(None, "a tokenizer other than the model's (folder, GGUF file or named model)",
                                    type=cli_types.path, metavar="T", group="data", resumed=Runs.DATA,
                                    key="tokenizer_name")
    loss_on: str = setting("completion", "completion: only the completion / assistant turns carry a loss (default); "
                                         "all: every token", choices=_loss_on, group="data", resumed=Runs.DATA)
    truncate: str = setting("truncate", "examples longer than --seq: cut them (default) or leave them out; counted in "
                                        "the report", choices=("truncate", "drop"), group="data", resumed=Runs.DATA)
    pack: bool = setting(False, "several examples a row, each attending only to itself (same loss and gradients as "
                                "unpacked): less padding where examples are much shorter than --seq and vary in "
                                "length; the run prints the padding both ways, so try it when it says unpacked is "
                                "over ~20%%", const=True, group="data", resumed=Runs.DATA, key="packing")
    answer_regex: str | None = setting(None, "exact match compares the first match of RE (its first group) in reply "
                                             "and reference (default: the last number in each, commas between "
                                             "digits dropped; a text without a number is compared whole, stripped "
                                             "of white space at either end: 'Paris.' is not 'Paris')", metavar="RE",
                                       group="data",
                                       resumed=Runs.DATA)
    max_new_tokens: int | None = setting(None, "longest reply generated in evaluation (default: 1.5x the longest "
                                               "reference + 8)", type=cli_types.positive, metavar="N", group="data",
                                          carried=Runs.DATA, shape=Either(None, Int(1)))
    epochs: float = setting(1.0, "epochs when --steps is not given (default 1)", type=cli_types.positive_float,
                            group="data", resumed=Runs.DATA, key="num_train_epochs")
    export: bool = setting(True, "do not write OUTPUT/model/, the Hugging Face folder a --data run writes",
                           flag="--no-export", const=False, group="data", carried=Runs.DATA, shape=bool)
    export_dtype: str | None = setting(None, "dtype of the exported weights (default: that of the weights the model "
                                             "came with)", choices=("float32", "bfloat16", "float16"), group="data",
                                         carried=Runs.DATA, shape=Either(None, str))
    #: a LoRA run's export: besides OUTPUT/adapter/, OUTPUT/model/ with the adapters merged into the base
    merge: bool = setting(False, "with --lora: also write OUTPUT/model/, the adapters merged into the base (a full "
                                 "Hugging Face folder; OUTPUT/adapter/ is written either way)", flag="--merge",
                          const=True, group="data", carried=Runs.DATA, shape=bool)
    steps: int | None = redefault(TrainConfig, "steps", None)
    lr: float = redefault(TrainConfig, "lr", 1e-4)
    warmup: int = redefault(TrainConfig, "warmup", 10)
    eval_size: int = redefault(TrainConfig, "eval_size", 200)

    @property
    def runs(self) -> Runs:
        return Runs.DATA


def resumed(cfg: TrainConfig) -> tuple[str, ...]:
    """The settings a resumed run of ``cfg``'s kind takes from the run it resumes (the plan comes with the
    checkpoint)."""
    return tuple(f.name for f in fields(cfg) if cfg.runs in setting_of(f).resumed)


def carried(cfg: TrainConfig) -> tuple[str, ...]:
    """The settings a resumed run of ``cfg``'s kind takes from the run it resumes unless a flag changes them."""
    return tuple(f.name for f in fields(cfg) if cfg.runs in setting_of(f).carried)


def resumed_shapes(cfg: TrainConfig) -> dict:
    """The shape (``util/jsonshape.py``) of each setting a resumed run of ``cfg``'s kind takes from ``metrics.json``,
    kept or carried (None: not checked)."""
    return {f.name: s.shape for f in fields(cfg) if cfg.runs in (s := setting_of(f)).resumed | s.carried}


def asked(cfg: TrainConfig) -> frozenset[str]:
    """The settings ``cfg`` asks for: those its command line gave (``cfg.given``); through the Python API, where
    a value equal to the default cannot be told from none given, those that differ from the defaults."""
    if cfg.given is not None:
        return cfg.given
    default = type(cfg)()
    return frozenset(f.name for f in fields(cfg) if getattr(cfg, f.name) != getattr(default, f.name))


def recorded(cfg: TrainConfig) -> dict:
    """``cfg``'s settings as ``metrics.json`` records them."""
    keep = {f.name for f in fields(cfg) if cfg.runs in setting_of(f).recorded}
    return {k: v for k, v in asdict(cfg).items() if k in keep}
