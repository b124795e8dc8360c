"""``lazytrain train``: the whole pipeline on the built-in arithmetic task, in one call.

    build model -> compile a plan for this machine -> Trainer + Hybrid 8-bit AdamW (warm-up + cosine)
    -> train (tqdm: loss, tokens/s all and with a label, TFLOPS; --report-to's trackers) -> exact match on the eval
    split -> metrics.json + checkpoint/

Choices, written down so the next person sees them:

- *Machine.* CUDA when there is a GPU (hardware profile matched by the GPU's name, bf16 parameters),
  else CPU mode (the ``cpu`` profile, fp32 parameters: CPUs have no fast bf16 matmul).
- *Model.* ``--model task`` (the default) is a small GPT sized for the task (``TASK_GPT``): the
  vocabulary is the char tokenizer's (98), rotary positions.  With the task's worked answers
  (``19+18=37``, see ``tasks/arith.py``) rotary positions are what make the arithmetic learnable in
  minutes: 84.5% exact match after 5 minutes against 13.5% after 4 with learned positions (plain
  PyTorch loop, 2 threads); with bare answers neither learned (14.4% / 9.0% after 9 minutes).
  Any preset, Hugging Face ``config.json`` folder (random init) or Hugging Face folder with weights
  (fine-tuning) works too, as long as its vocabulary covers the tokenizer's ids.
- *Loss.* On every token of the sequence by default (``--answer-only-loss`` for the answer and its
  eos only).  Measured on the task GPT at batch 32, lr 3e-3: answer-only was still at ~1% exact
  match after 1,000 steps (it answers "1", "11", "101" whatever the question: nothing reads the
  numbers yet), whole-sequence reached 13% at 2,000 steps and rising.  The prompt repeats its name
  and item ("Mia has 23 pens ... How many pens now?"), and predicting the repeats trains the
  look-back attention that reading the numbers needs; the answer alone is ~4 labels per example.
  With worked answers the same held: 7.0% (answer-only) against 13.5% (whole sequence) after 4
  minutes, learned positions.
- *Optimizer.* Hybrid 8-bit AdamW, betas (0.9, 0.98) (the shorter second-moment memory suits a
  run of a few thousand steps), no weight decay, global norm clipped to 1.
- *Schedule.* Linear warm-up, then cosine to ``min_lr_ratio * lr``.  Its progress is the larger of
  the step fraction and the time fraction of ``--time-limit-min``, so on a slow or busy machine the
  learning rate still anneals before time runs out instead of stopping at a high rate.  The
  optimizer's ``lr`` is set before every step (the host optimizer reads it at each update).
- *Stopping.* Ctrl-C once: the step in flight finishes, then checkpoint and metrics are written as
  usual (marked ``interrupted``) and the final eval is skipped; twice: stop now, write nothing.
  During the final eval (the state is already committed) one Ctrl-C stops it at once.
- *Files.* Checkpoint and metrics are one commit (``runfiles.py``): a kill at any moment leaves the
  previous complete state or the new one.  The run owns its output folder (``runfolder.py``): locked, a run over
  another run refused without ``--overwrite``, nothing in it read or written through a link.
- *Task.* ``--difficulty`` is a preset of ``tasks/arith.py``, optionally in answer formats
  (``tiny-pad-rev``, ``tasks/formats.py``): the same problems and split, the worked answer written so the
  arithmetic is easier for a small model; exact match reads the final number in that format.
- *Resume.* ``--resume DIR`` (an output folder) rebuilds the model from the metrics committed with
  ``DIR/checkpoint`` (a config: data, never code unless ``--allow-factory``), loads the checkpoint and
  continues to ``--steps`` (a total, not an increment); the data stream is replayed to the same
  position, so a resumed run sees the batches an uninterrupted one would.
- *Sizes.* Every size is checked before any work: batch and sequence (``ir/limits.py``, and a step's
  batch of token ids at most ``MAX_BATCH_TOKENS``), ``--eval-size`` (at most the distinct eval problems
  the difficulty has), ``--threads`` (at most the cores), ``--seed`` (a 63-bit integer).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import replace
from pathlib import Path

import torch
from tabulate import tabulate

from ..compiler.progress import on_stderr
from ..compiler.timeline import write_step
from ..frontend.presets import PRESETS, build_from_config, build_model, read_config
from ..frontend.validate import check_positions, check_sizes
from ..hf.generate import placement
from ..hf.model_loading import from_pretrained as _from_pretrained
from ..hf.model_loading import is_hf_folder as _is_hf_folder
from ..hf.model_loading import meta_weights, shard_loadable
from ..tasks import CharTokenizer, check_eval_size, eval_examples, get_difficulty, predict, train_batches
from ..util.atomic import staged_files
from ..util.host import cpu_cores
from . import runfiles, saves
from .config import TrainConfig
from .finetune import is_finetune_run
from .finetune import run as finetune
from .loop import Progress, open_run, start_trainer, steps, thread_tuner
from .ranks import Ranks
from .runfolder import claim
from .session import StopFlag, can_plot, follow_total, hardware_for, note, progress_bar, say_no_plot, stop_signals
from .trackers import Trackers
from .trackers import check as check_trackers

#: the default model for the "tiny" task, sized to learn it in minutes on 2 CPU cores
TASK_GPT = {"d_model": 128, "n_layer": 4, "n_head": 4, "d_ff": 512, "rope": True}
#: token ids in one batch of the task (batch x seq), generated on the host each step: 2^20 [ledger: train-batch-tokens]
MAX_BATCH_TOKENS = 1 << 20


def build_task_model(cfg: TrainConfig, seq: int, vocab: int, shard: bool = False) -> tuple[torch.nn.Module, dict]:
    """The model to train, in fp32 on the CPU (the Trainer copies it into its host store), and a JSON
    description that rebuilds it (for ``--resume``).  ``shard`` (one of several ranks): a pretrained
    safetensors folder's model on the meta device instead, its weights read a rank's pieces at a time
    (``model_loading.meta_weights``).  Other models are built whole on every rank: their modules' own init draws
    in construction order from one generator, so no piece can be drawn alone (fine-tunes use ``random_init``)."""
    torch.manual_seed(cfg.seed)
    if cfg.model == "task":
        spec = {"model_type": "lazytrain-gpt", "vocab": vocab, "max_seq": seq, "tie_weights": True,
                **TASK_GPT, **cfg.extra}
        return build_from_config(spec, device="cpu", dtype=torch.float32, source="task model"), {"config": spec}
    path = Path(cfg.model)
    if cfg.model in PRESETS:
        model = build_model(cfg.model, device="cpu", dtype=torch.float32)
        desc = {"config": PRESETS[cfg.model]}
    elif path.is_dir() and not (path / "config.json").is_file():
        raise ValueError(f"--model {cfg.model}: the folder has no config.json (a Hugging Face model folder holds "
                         f"config.json and, to fine-tune them, its weights as *.safetensors)")
    elif _is_hf_folder(cfg.model):
        model = shard_loadable(path)[0] if shard and any(path.glob("*.safetensors")) else _from_pretrained(path)
        desc = {"pretrained": str(path.resolve()), "config": read_config(path / "config.json")}
        if any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            print(f"note: {cfg.model}'s tokenizer is not used: the task's character tokenizer ({vocab} ids) "
                  f"feeds ids 0-{vocab - 1} of the model's embedding")
    elif path.is_dir() or path.is_file():       # a config.json, or a folder with only one: random init
        conf = path / "config.json" if path.is_dir() else path
        desc = {"config": read_config(conf)}
        model = build_from_config(desc["config"], device="cpu", dtype=torch.float32, source=str(conf))
    else:
        model = build_model(cfg.model, device="cpu", dtype=torch.float32)
        desc = {"spec": cfg.model}
    _check_fits(model, seq, vocab, cfg.model)
    return model, desc


def _check_fits(model: torch.nn.Module, seq: int, vocab: int, name: str) -> None:
    c = getattr(model, "config", None)
    have_vocab = getattr(c, "vocab", None) or getattr(c, "vocab_size", None)
    if have_vocab is not None and have_vocab < vocab:
        raise ValueError(f"model {name!r} has a vocabulary of {have_vocab} but the task's character tokenizer "
                         f"uses ids 0-{vocab - 1}: it needs a vocab_size of at least {vocab}")
    check_positions(model, seq, f"model {name!r}")


def rebuild_model(desc: dict, *, allow_factory: bool = False, device: str = "cpu") -> torch.nn.Module:
    """The model described by ``build_task_model``'s description (weights come from the checkpoint).
    Only data is used: the recorded config (a fine-tuned folder's weights are in the checkpoint, so the
    folder is not read); a ``package.module:factory`` is imported only with ``allow_factory``.  ``device``
    "meta" (one of several ranks): nothing of it is allocated; the trainer reads its shard of the checkpoint
    (``weights.CheckpointFilled``)."""
    if "config" in desc:
        return build_from_config(desc["config"], device=device, dtype=torch.float32, source="checkpoint")
    if not allow_factory:
        raise ValueError(f"the run's model is built by the factory {desc.get('spec')!r}: resuming would import and "
                         f"run it; pass --allow-factory if you trust the run folder")
    return build_model(desc["spec"], device=device, dtype=torch.float32)


def logits_fn(model: torch.nn.Module, device: torch.device, vocab: int | None = None):
    """input_ids [B, T] -> logits [B, T, V] for our GPT and Hugging Face causal LMs alike; with ``vocab``,
    only the first ``vocab`` ids (a model with a larger vocabulary than the tokenizer's then never
    decodes to an id the tokenizer does not have)."""
    def fn(ids: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=ids.to(device))
        logits = out if isinstance(out, torch.Tensor) else out.logits
        return (logits[..., :vocab] if vocab is not None else logits).float()
    return fn


@torch.no_grad()
def evaluate(trainer, examples, device: torch.device, batch: int = 100, ranks: Ranks | None = None) -> dict:
    """Exact match by greedy decoding with the trained weights (``sync_to_model``, then the model
    runs eagerly; on the GPU when it fits in a quarter of the free memory, else on the CPU), and the first
    ``SAMPLES`` replies (for ``--report-to``): ``{"exact_match", "samples"}``.  With several ranks every rank
    calls it: each gathers the weights (a collective), rank 0 decodes and the others take its figure
    (``Ranks.share``)."""
    ranks = ranks or Ranks()
    trainer.sync_to_model(keep=ranks.main)      # the others hold one block at a time, not a model
    return ranks.share("evaluation", lambda: _exact_match(trainer.model, examples, device, batch))


#: replies an evaluation keeps as samples
SAMPLES = 3


def _exact_match(model, examples, device: torch.device, batch: int) -> dict:
    where = placement(model, device)
    was_training = model.training
    model.eval()
    moved = model.to(where) if where.type != "cpu" else model
    try:
        got = predict(logits_fn(moved, where, CharTokenizer().vocab_size), examples, batch)
        hits = [ex.final_answer(g) == ex.answer for g, ex in zip(got, examples)]
        return {"exact_match": sum(hits) / len(examples),
                "samples": [{"prompt": ex.prompt, "reference": ex.solution, "reply": g, "correct": h}
                            for ex, g, h in list(zip(examples, got, hits))[:SAMPLES]]}
    finally:
        if where.type != "cpu":
            model.to("cpu")
        model.train(was_training)


# ---- the job -----------------------------------------------------------------------------------------

def check_config(cfg: TrainConfig, diff, seq: int) -> None:
    """Every setting in range before any work (see *Sizes* in the module docstring)."""
    for name in ("batch", "steps"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name} must be positive, got {getattr(cfg, name)}")
    if seq < diff.seq_len:
        raise ValueError(f"--seq {seq} is shorter than the longest {diff.name!r} example ({diff.seq_len} tokens)")
    try:
        check_sizes(cfg.batch, seq)
    except ValueError as e:
        raise ValueError(f"--batch {cfg.batch} --seq {seq}: {e}") from None
    if cfg.batch * seq > MAX_BATCH_TOKENS:
        raise ValueError(f"--batch {cfg.batch} x --seq {seq} is {cfg.batch * seq:,} tokens a step; the task generates "
                         f"at most {MAX_BATCH_TOKENS:,} (lower the batch, or the sequence: the longest "
                         f"{diff.name!r} example is {diff.seq_len} tokens)")
    if cfg.profile is not None and cfg.profile < 1:
        raise ValueError(f"--profile STEP counts from 1, got {cfg.profile}")
    if cfg.eval_every < 0 or cfg.warmup < 0:
        raise ValueError("--eval-every and --warmup must be >= 0")
    if cfg.nvme_memory and not cfg.nvme_dir:
        raise ValueError("--nvme-memory needs --nvme-dir (the folder for what does not fit the host budget)")
    if not 0 < cfg.lr < math.inf:
        raise ValueError(f"--lr must be a positive number, got {cfg.lr}")
    if cfg.time_limit_min is not None and cfg.time_limit_min <= 0:
        raise ValueError(f"--time-limit-min must be positive, got {cfg.time_limit_min}")
    if not isinstance(cfg.seed, int) or not 0 <= cfg.seed < 1 << 63:
        raise ValueError(f"--seed must be a whole number in [0, 2**63), got {cfg.seed}")
    cores = cpu_cores()
    if cfg.threads is not None and not 1 <= cfg.threads <= cores:
        raise ValueError(f"--threads {cfg.threads}: this machine gives this process {cores} cores, and "
                         f"more threads than cores only wait for each other: at most {cores}")
    check_eval_size(cfg.eval_size, diff)


def run(cfg: TrainConfig) -> dict:
    """Train as ``cfg`` says; returns the metrics (also written to ``cfg.output/metrics.json``).  The run owns its
    output folder while it lasts (``runfolder.claim``: locked, never written through a link)."""
    saves.settle(cfg)       # --resume-from-checkpoint: the run folder to resume
    with claim(cfg, main=int(os.environ.get("RANK", "0")) == 0):      # (the launcher's rank: Ranks.join reads it)
        saves.pick(cfg)     # its newest complete checkpoint
        if getattr(cfg, "data", None) is not None or is_finetune_run(cfg.resume, cfg.resumed_checkpoint):
            return finetune(cfg)
        return _run_task(cfg)


def _run_task(cfg: TrainConfig) -> dict:
    cfg, prev, diff, seq = _settled(cfg)
    check_trackers(cfg.report_to)       # a tracker's missing library: said before the model is built
    if cfg.lora:
        raise ValueError("--lora adapts a pretrained model: use it with --data (the built-in task's model trains "
                         "from scratch)")
    tok = CharTokenizer()
    dev, ranks, out, t_start = open_run(cfg)

    model, desc, weights = _model(cfg, prev, seq, tok.vocab_size, ranks)
    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    param_dtype = "bfloat16" if dev.type == "cuda" else "float32"
    hardware = cfg.hardware or hardware_for(dev)
    # the compile's stages on a terminal while it runs (seconds for a 7B model), as ``lazytrain compile`` shows them
    with on_stderr("lazytrain train: compile: ", "auto" if cfg.progress and ranks.main else "off"):
        trainer, opt, compile_s = start_trainer(cfg, model, dev, resumed=prev is not None, seq_len=seq,
                                                hardware=hardware, param_dtype=param_dtype, ranks=ranks,
                                                weights=weights)
    plan, start = trainer.plan, trainer.steps if prev is not None else 0
    param_dtype = plan.param_dtype if prev is not None else param_dtype
    where = f"cpu, {torch.get_num_threads()} threads" if dev.type == "cpu" else dev.type
    print(f"model {cfg.model}: {n_params / 1e6:.2f} M parameters on {where} ({param_dtype}); plan: "
          f"{plan.decisions.policy}, micro-batch {plan.micro_batch} x {plan.n_micro}, compiled in {compile_s:.1f} s")

    batches = train_batches(cfg.batch, difficulty=diff, seed=cfg.seed, seq_len=seq, tokenizer=tok,
                            loss_on_prompt=cfg.loss_on_prompt)
    for _ in range(start):          # replay the stream to where the checkpoint stopped
        next(batches)
    evals = eval_examples(cfg.eval_size, diff, seed=cfg.seed)
    em_curve = list(prev["eval_curve"]) if prev else []
    run = Progress(start, tokens=int(prev["tokens"]) if prev else 0, history=list(prev["loss_curve"]) if prev else [])
    tuner = thread_tuner(dev, cfg, opt) if ranks.size == 1 else None

    def metrics_now() -> dict:
        return saver.stamp(_metrics(cfg, seq, run, desc=desc, n_params=n_params, dev=dev, tuner=tuner,
                                    hardware=hardware, param_dtype=param_dtype, plan=plan, compile_s=compile_s,
                                    evals=evals, em_curve=em_curve, prev=prev, t_start=t_start, out=out))
    saver = saves.Saver(cfg, trainer, out, metrics_now, main=ranks.main, prev=prev)
    with StopFlag(stop_signals(ranks.size)) as flag, Trackers.open(cfg, out, ranks.main) as trackers:
        trackers.start({**runfiles.settings(cfg, seq), "params": n_params, "device": dev.type,
                        "policy": plan.decisions.policy})
        _train(cfg, trainer, opt, run, flag, batches, evals, em_curve, start=start, dev=dev, ranks=ranks, tuner=tuner,
               out=out, t_start=t_start, saver=saver, trackers=trackers)
        metrics = metrics_now()
        ckpt = _commit(trainer, out, metrics, run, evals if cfg.evaluate else None, em_curve, dev, flag, t_start,
                       ranks, trackers)
        trackers.end(metrics)
        if ranks.main:
            _plot_loss(out / "loss.png", run.history, metrics["eval_curve"], cfg)
    trainer.close()
    print(f"wrote {out / 'metrics.json'} and {ckpt}" + (" (interrupted: no final eval)"
                                                         if metrics["final_eval"] == "skipped (interrupted)" else ""))
    ranks.close()
    return metrics


def _settled(cfg: TrainConfig) -> tuple[TrainConfig, dict | None, object, int]:
    """The run's settings (a resumed run's from its checkpoint, the difficulty by its canonical name), checked; what
    a resumed run committed (None); the difficulty; the sequence length."""
    prev = None
    if cfg.resume:
        cfg, prev = runfiles.load_resume(cfg)
    diff = get_difficulty(cfg.difficulty)
    cfg = replace(cfg, difficulty=diff.name)    # "tiny-rev-pad" is recorded as "tiny-pad-rev": one name a task
    seq = cfg.seq or diff.seq_len
    check_config(cfg, diff, seq)
    return cfg, prev, diff, seq


def _model(cfg: TrainConfig, prev: dict | None, seq: int, vocab: int, ranks: Ranks):
    """(model, its description, where its initial weights come from): a resumed run's rebuilt from what it
    recorded (with several ranks on the meta device: each reads its shard of the checkpoint), a new one built."""
    if prev is not None:
        from ..runtime.weights import CheckpointFilled
        weights = CheckpointFilled() if ranks.size > 1 else None
        model = rebuild_model(prev["model"], allow_factory=cfg.allow_factory, device="meta" if weights else "cpu")
        return model, prev["model"], weights
    model, desc = build_task_model(cfg, seq, vocab, shard=ranks.size > 1)
    return model, desc, meta_weights(model, desc)


def _train(cfg: TrainConfig, trainer, opt, run: Progress, flag: StopFlag, batches, evals: list, em_curve: list, *,
           start: int, dev: torch.device, ranks: Ranks, tuner, out: Path, t_start: float, saver=None,
           trackers: Trackers | None = None) -> None:
    """The step loop: each step's batch, the ``--profile`` step's report, the progress bar, the ``--eval-every``
    evaluations (into ``em_curve``), the ``--save-steps`` checkpoints (``saver``), each step and evaluation to the
    ``--report-to`` trackers."""
    trackers = trackers or Trackers([])
    bar = progress_bar(cfg.steps, start, cfg.progress and ranks.main)
    for step in steps(cfg, opt, run, flag, start=start, ranks=ranks):
        b = next(batches)
        profiled = cfg.profile is not None and step + 1 == max(cfg.profile, start + 1)
        trainer.profile = profiled
        stats = trainer.step({"input_ids": b.input_ids, "labels": b.labels})
        if tuner is not None and not profiled:
            tuner.observe(stats.step_s)
        if profiled:
            trainer.profile = False
            if ranks.main:
                _report_profile(trainer, out, bar)
        run.record(stats, opt.lr, t_start)
        follow_total(bar, run.total)
        trackers.step(run.step, stats, opt.lr)
        if bar is not None:
            bar.set_postfix(loss=f"{stats.loss:.3f}", tok_s=f"{stats.tokens_per_s:,.0f}",
                            loss_tok_s=f"{stats.tokens / stats.step_s:,.0f}", tflops=f"{stats.model_tflops:.3f}",
                            lr=f"{opt.lr:.1e}", refresh=False)
            bar.update(1)
        if cfg.evaluate and cfg.eval_every and run.step % cfg.eval_every == 0 and run.step < cfg.steps:
            ev = evaluate(trainer, evals[:min(len(evals), 200)], dev, ranks=ranks)
            em_curve.append({"step": run.step, "exact_match": ev["exact_match"], "n": min(len(evals), 200)})
            trackers.evaluate(run.step, ev)
            note(bar, f"step {run.step}: exact match {ev['exact_match']:.1%} on {min(len(evals), 200)} eval problems")
        if saver is not None:
            saver.step(run.step, bar)
    if bar is not None:
        bar.close()


def _metrics(cfg: TrainConfig, seq: int, run: Progress, *, desc, n_params: int, dev: torch.device, tuner, hardware,
             param_dtype: str, plan, compile_s: float, evals: list, em_curve: list, prev: dict | None, t_start: float,
             out: Path) -> dict:
    """metrics.json as commit 1 writes it (the final eval is still pending)."""
    recent = run.history[-min(50, len(run.history)):] if run.history else []
    return {
        "format": runfiles.METRICS_FORMAT,
        "settings": runfiles.settings(cfg, seq),
        "model": desc, "params": n_params, "device": dev.type, "threads": torch.get_num_threads(),
        "thread_rounds": [{"step": st, "median_step_s": {str(k): round(v, 4) for k, v in m.items()}}
                          for st, m in (tuner.history if tuner else [])],
        "hardware": hardware, "param_dtype": param_dtype,
        "plan": {"policy": plan.decisions.policy, "micro_batch": plan.micro_batch, "n_micro": plan.n_micro,
                 "n_ops": len(plan.ops), "predicted_step_s": plan.predicted.get("step_time_s"),
                 "resident_blocks": sorted(plan.decisions.resident_blocks), "compile_s": round(compile_s, 2)},
        "steps_done": run.step, "peak_lr": run.peak_lr, "tokens": run.tokens, "stop_reason": run.stop_reason,
        "interrupted": run.interrupted,
        "stopped_by": run.stopped_by,
        "exact_match": None, "final_eval": "skipped (interrupted)" if run.interrupted else "pending",
        "eval_size": len(evals), "eval_curve": em_curve, "loss_curve": run.history,
        "final_loss": sum(h["loss"] for h in recent) / len(recent) if recent else None,
        "train_s": round(run.train_s + (prev["train_s"] if prev else 0.0), 2),
        "wall_s": round(time.perf_counter() - t_start, 2), "load_average": list(os.getloadavg()),
        "checkpoint": str(out / "checkpoint"), "resumed_from": cfg.resume,
    }


def _commit(trainer, out: Path, metrics: dict, run: Progress, evals: list | None, em_curve: list, dev: torch.device,
            flag: StopFlag, t_start: float, ranks: Ranks, trackers: Trackers | None = None) -> Path:
    """Commit 1 (checkpoint + metrics) before the final eval, so an eval that fails (out of memory) or is
    killed loses no training; then the eval and commit 2 (the metrics with it).  Every rank saves its
    shards; the metrics are rank 0's.  ``evals`` None: no eval (``--no-eval``)."""
    if evals is None:
        metrics.update(final_eval="skipped (--no-eval)")
    ckpt = runfiles.commit(trainer, out, metrics, main=ranks.main)
    if evals is not None and not run.interrupted:         # (a Ctrl-C during commit 1 skips the eval too)
        ev = None if flag.set else _final_eval(trainer, evals, dev, flag, ranks)
        if ev is None:
            metrics.update(final_eval="skipped (interrupted)", interrupted=True,
                           stopped_by=flag.signal.name if flag.signal else "SIGINT")
        else:
            em_curve.append({"step": run.step, "exact_match": ev["exact_match"], "n": len(evals)})
            metrics.update(exact_match=ev["exact_match"], final_eval="done")
            if trackers is not None:
                trackers.evaluate(run.step, ev)
        metrics["wall_s"] = round(time.perf_counter() - t_start, 2)
        if ranks.main:
            runfiles.update_metrics(out, metrics)       # commit 2
    return ckpt


def _final_eval(trainer, evals, dev: torch.device, flag: StopFlag, ranks: Ranks | None = None) -> dict | None:
    """Exact match on the eval split, with sample replies (``evaluate``); None when a Ctrl-C stopped it (at once:
    the state is committed)."""
    t = time.perf_counter()
    flag.immediate = True
    try:
        ev = evaluate(trainer, evals, dev, ranks=ranks)
    except KeyboardInterrupt:
        print("final eval interrupted: the checkpoint and metrics are committed without it")
        return None
    finally:
        flag.immediate = False
    print(f"exact match {ev['exact_match']:.1%} on {len(evals)} eval problems ({time.perf_counter() - t:.1f} s)")
    return ev


def _report_profile(trainer, out: Path, bar) -> None:
    """The ``--profile`` step: hidden fractions on the console; profile, measured trace and memory plot."""
    prof = trainer.last_profile
    rows = [[kind, f"{prof.transfer_s.get(kind, 0.0) * 1e3:.1f}", f"{100 * frac:.0f}%"]
            for kind, frac in prof.hidden.items()]
    rows.append(["update (host)", f"{prof.update_s * 1e3:.1f}",
                 f"{100 * (1 - prof.exposed_update_s / prof.update_s):.0f}%" if prof.update_s else "-"])
    text = tabulate(rows, headers=["work", "busy ms", "hidden under compute"], tablefmt="plain")
    with staged_files(out, "profile") as tmp:        # renamed into the run folder: never written through a link
        prof.save(tmp / "profile.json", trainer.plan)
        trainer.plan.save(tmp / "plan.json")      # the pair `lazytrain profile --step` reads
        notes = [f"profiled step: {prof.step_s * 1e3:.1f} ms", text,
                 f"wrote {out / 'profile.json'} and {out / 'plan.json'}"]
        plot = tmp / "memory.png" if can_plot() else None
        notes += [n.replace(str(tmp), str(out)) for n in write_step(trainer.plan, tmp / "trace.json", plot=plot,
                                                                     profile=prof)]
    note(bar, "\n".join(notes))


def _plot_loss(path: Path, history: list[dict], em_curve: list[dict], cfg: TrainConfig) -> None:
    """``loss.png`` next to metrics.json when matplotlib is installed (else a line saying why not)."""
    if not can_plot():
        say_no_plot("loss.png")
        return
    last = em_curve[-1] if em_curve else None
    title = f"model {cfg.model}, task {cfg.difficulty}, batch {cfg.batch}" + (
        f": exact match {last['exact_match']:.1%} at step {last['step']}" if last else "")
    runfiles.plot_into(path, {"train loss": [(h["step"], h["loss"]) for h in history]}, title=title)
