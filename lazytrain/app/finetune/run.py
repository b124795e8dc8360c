"""``lazytrain train --data FILE``: fine-tune a pretrained model on your examples, evaluate it by
generation, and export it as a Hugging Face folder.

    model + tokenizer (prepare.py) -> examples (data/) -> plan (packed with --pack) -> Trainer + Hybrid
    8-bit AdamW (warm-up + cosine) -> eval before -> train (eval every --eval-every) -> commit 1 (checkpoint +
    metrics, final eval pending) -> eval after -> OUTPUT/model/ (export.py) -> commit 2 (the metrics with them) +
    loss.png

A run killed at any point resumes from its last commit (``runfiles``: the metrics that count are the copy inside
the checkpoint, checked against its step), never with a loss curve missing steps.

What is shared with the built-in task's ``train.py``: the settings (``config.py``), the device, progress bar and
signals (``session.py``), the thread choice (and the thread tuner on the CPU) and the learning-rate
schedule (by steps and by time, whichever is further: ``loop.py``), the commits (``runfiles.py``).  What
differs: the data is a file, one epoch by default (``--epochs``); the evaluation generates replies with the
model's tokenizer and stop tokens; the result is also a model folder anyone can load.  A resumed run
(``--resume OUTPUT``) takes its settings, tokenizer and config from the run (``OUTPUT/source/``) and refuses data
files that changed.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import asdict, fields
from pathlib import Path

import torch

from ...data.batches import Batches
from ...data.encode import Encoder
from ...data.formats import check_columns
from ...frontend.lora import parse_lora, wrap
from ...frontend.presets import build_model
from ...frontend.random_init import random_init
from ...hf.export import hf_config, trainer_weights, write_folder, write_hf_json
from ...hf.model_loading import shard_loadable
from ...hf.named import generation_config
from ...runtime.checkpoint import read_extra, read_meta
from ...runtime.manifest import CheckpointError
from ...util.atomic import staged_folder
from .. import runfiles, saves
from ..config import FinetuneConfig, TrainConfig, asked, recorded
from ..loop import Progress, open_run, start_trainer, steps, thread_tuner
from ..runfiles import nan_losses, plot_into, take_settings
from ..session import StopFlag, can_plot, follow_total, hardware_for, note, progress_bar, say_no_plot, stop_signals
from ..trackers import Trackers
from ..trackers import check as check_trackers
from . import lora_export
from .evaluation import describe, evaluate
from .prepare import (
    Source,
    build,
    check_vocab,
    max_new_tokens,
    max_positions,
    pad_id,
    prepare_data,
    resolve,
    set_chat_template,
    tokenizer_for,
)

FORMAT = "lazytrain.finetune-metrics/1"


def is_finetune_run(folder, ckpt=None) -> bool:
    """Is ``folder`` the output of a ``--data`` run (its metrics say so; ``ckpt``: the checkpoint a resume reads)?"""
    try:
        return bool(folder) and _committed(Path(folder), ckpt)[0].get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _committed(src: Path, ckpt=None) -> tuple[dict, int | None]:
    """(the metrics committed with the checkpoint of the run folder ``src``, the checkpoint's step): the copy inside
    the checkpoint (``runfiles.commit``; ``ckpt``, else ``src/checkpoint``); the folder's own for a checkpoint saved
    without it (an older run, whose step is then checked against the checkpoint's), with step None when there is no
    checkpoint."""
    try:
        folder, meta = read_meta(ckpt or src / "checkpoint")
    except CheckpointError:
        return json.loads((src / runfiles.METRICS).read_text()), None
    if runfiles.METRICS in meta["extras"]:
        return json.loads(read_extra(folder, meta, runfiles.METRICS).decode("utf-8")), meta["step"]
    return json.loads((src / runfiles.METRICS).read_text()), meta["step"]


def _resume(cfg: FinetuneConfig) -> tuple[FinetuneConfig, dict]:
    src = Path(cfg.resume)
    try:
        prev, at = _committed(src, cfg.resumed_checkpoint)
        saved, done = prev["settings"], int(prev["steps_done"])
        nan_losses(prev["loss_curve"])
        curve = [h["step"] for h in prev["loss_curve"]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"--resume {src}: not the output folder of a `lazytrain train --data` run ({e})") from None
    if at is None or done != at or curve != list(range(1, done + 1)):
        raise ValueError(f"--resume {src}: its metrics record {done} steps and a loss curve of {len(curve)}, its "
                         f"checkpoint {'is missing' if at is None else f'step {at}'}: the files do not belong "
                         f"together (edited, or written by a run killed between its checkpoint and its metrics)")
    take_settings(cfg, saved, src)
    if cfg.steps is not None and cfg.steps < done:
        raise ValueError(f"--resume {src}: the run is already at step {done}; --steps is the total to reach "
                         f"(ask for more than {done})")
    cfg.tokenizer = str(src / "source")
    return cfg, prev


def _settled(cfg: TrainConfig) -> tuple[FinetuneConfig, dict | None]:
    """The run's settings (a resumed run's from its folder) and what the resumed run committed (None)."""
    if not isinstance(cfg, FinetuneConfig):       # `lazytrain train --resume DIR` of a --data run
        known = {f.name for f in fields(FinetuneConfig)}
        cfg = FinetuneConfig(**{k: v for k, v in asdict(cfg).items() if k in known} | {"given": asked(cfg)})
    prev = None
    if cfg.resume:
        cfg, prev = _resume(cfg)
    for flag, name in (("--data", cfg.data), ("--eval-data", cfg.eval_data)):
        if name is not None and not str(name).strip():
            raise ValueError(f"{flag} {name!r}: an empty name names no file")
    if not cfg.data:
        raise ValueError("lazytrain train --data FILE: no data file given")
    if cfg.columns is not None:             # (a config file's mapping is checked here, a flag's as it is parsed)
        cfg.columns = check_columns(cfg.columns)
    if cfg.text_field:
        cfg.columns = check_columns({cfg.text_field: "text", **(cfg.columns or {})})
    if cfg.answer_regex is not None:        # before minutes of loading: a typo is an error at once
        try:
            re.compile(cfg.answer_regex)
        except re.error as e:
            raise ValueError(f"--answer-regex {cfg.answer_regex!r}: not a regular expression ({e})") from None
    return cfg, prev


def _tick(bar, stats, lr: float) -> None:
    """The progress bar's step: ``tok_s`` every token the step ran (batch x seq), ``loss_tok_s`` those with a
    label."""
    if bar is not None:
        bar.set_postfix(loss=f"{stats.loss:.3f}", tok_s=f"{stats.tokens_per_s:,.0f}",
                        loss_tok_s=f"{stats.tokens / stats.step_s:,.0f}", lr=f"{lr:.1e}", refresh=False)
        bar.update(1)


def run(cfg: TrainConfig) -> dict:
    """Fine-tune as ``cfg`` says; returns the metrics (also written to ``cfg.output/metrics.json``)."""
    cfg, prev = _settled(cfg)
    check_trackers(cfg.report_to)       # a tracker's missing library: said before the model loads
    dev, ranks, out, t_start = open_run(cfg)

    src, tok, data, model, weights, stop_ids, load_s = _inputs(cfg, prev, dev, out, main=ranks.main,
                                                               shard=ranks.size > 1)
    setup_s = time.perf_counter() - t_start      # the model fetched and built, the data read and encoded
    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    param_dtype = "bfloat16" if dev.type == "cuda" else "float32"
    hardware = cfg.hardware or hardware_for(dev)
    batches = Batches(data.train, cfg.batch, data.seq_len, pad_id(tok), pack=cfg.pack, seed=cfg.seed)
    if cfg.steps is None:
        cfg.steps = max(1, math.ceil(cfg.epochs * batches.steps_per_epoch))
    trainer, opt, compile_s = start_trainer(cfg, model, dev, resumed=prev is not None, seq_len=data.seq_len,
                                            hardware=hardware, param_dtype=param_dtype, packed=cfg.pack, ranks=ranks,
                                            weights=weights)
    if cfg.lora:        # what its checkpoints record of the base: the export's --merge reads it from there
        trainer.base_source = lora_export.base_record(cfg.model, src)
    plan, start = trainer.plan, trainer.steps if prev is not None else 0
    if dev.type == "cuda":
        # the trainer's host store holds the fp32 masters; the model is only what evaluation runs (in bf16 on
        # the GPU), so it need not hold a second fp32 copy: a 7B's host memory is 15 GB less
        model.to(torch.bfloat16)
    pad = batches.padding()
    _say_start(cfg, src, data, batches, pad, plan, n_params=n_params, dev=dev, param_dtype=param_dtype, load_s=load_s,
               compile_s=compile_s)

    n_new = cfg.max_new_tokens or max_new_tokens(tok, data.eval)
    tuner = thread_tuner(dev, cfg, opt, **TUNER) if ranks.size == 1 else None

    spent = {"evaluations": 0.0, "export": 0.0}

    def run_eval(step: int) -> dict:
        t_eval = time.perf_counter()
        try:
            return timed_eval(step)
        finally:
            spent["evaluations"] += time.perf_counter() - t_eval

    def timed_eval(step: int) -> dict:
        threads = torch.get_num_threads()
        if tuner is not None:           # the count last measured fastest, not whichever a probe left
            torch.set_num_threads(_fastest(tuner) or threads)
        try:
            ev = evaluate(trainer, tok, data.eval, stop_ids=stop_ids, pad_id=pad_id(tok),
                          max_new_tokens=n_new, device=dev, answer_regex=cfg.answer_regex, ranks=ranks)
        finally:
            torch.set_num_threads(threads)
        return {"step": step, **ev}

    evals = list(prev["eval_curve"]) if prev else []
    run = Progress(start, tokens=int(prev["tokens"]) if prev else 0, history=list(prev["loss_curve"]) if prev else [])
    if prev is None and data.eval:
        evals.append(run_eval(0))
        print(describe(evals[-1], 0))
    bar = progress_bar(cfg.steps, start, cfg.progress and ranks.main)
    ckpt = out / "checkpoint"

    def metrics_now(exported: dict | None, final_eval: str) -> dict:
        return saver.stamp(_metrics(cfg, run, src=src, model=model, n_params=n_params, dev=dev, hardware=hardware,
                                    param_dtype=param_dtype, data=data, batches=batches, pad=pad, stop_ids=stop_ids,
                                    n_new=n_new, plan=plan, compile_s=compile_s, evals=evals, prev=prev,
                                    t_start=t_start, ckpt=ckpt, exported=exported, final_eval=final_eval))
    saver = saves.Saver(cfg, trainer, out, lambda: metrics_now(None, "pending"), main=ranks.main, prev=prev)
    with StopFlag(stop_signals(ranks.size)) as flag, Trackers.open(cfg, out, ranks.main) as trackers:
        trackers.start({**recorded(cfg), "model_source": src.spec, "params": n_params, "device": dev.type,
                        "policy": plan.decisions.policy})
        if evals and evals[-1]["step"] == start:
            trackers.evaluate(start, evals[-1])     # the eval before training
        for step in steps(cfg, opt, run, flag, start=start, ranks=ranks):
            stats = trainer.step(batches.batch(step))
            if tuner is not None:
                tuner.observe(stats.step_s)
            run.record(stats, opt.lr, t_start, tokens=True)
            follow_total(bar, run.total)
            trackers.step(run.step, stats, opt.lr)
            _tick(bar, stats, opt.lr)
            if cfg.eval_every and run.step % cfg.eval_every == 0 and run.step < cfg.steps and data.eval:
                evals.append(run_eval(run.step))
                trackers.evaluate(run.step, evals[-1])
                note(bar, describe(evals[-1], run.step))
            saver.step(run.step, bar)
        if bar is not None:
            bar.close()
        # commit 1: checkpoint + metrics in one (``runfiles``): a kill before commit 2 resumes from here
        metrics = metrics_now(None, "skipped (interrupted)" if run.interrupted else "pending")
        runfiles.commit(trainer, out, metrics, main=ranks.main)
        exported, final_eval = None, "skipped (interrupted)"
        if not run.interrupted:
            flag.immediate = True       # committed: a signal stops the final eval or the export at once
            try:
                if flag.set:            # (one during commit 1)
                    raise KeyboardInterrupt
                if data.eval:
                    evals.append(run_eval(run.step))
                    trackers.evaluate(run.step, evals[-1])
                    print(describe(evals[-1], run.step))
                final_eval = "done" if data.eval else "skipped (--no-eval)"
                if cfg.export and ranks.main:
                    t_export = time.perf_counter()
                    exported = _export(cfg, src, param_dtype, out / "model", trainer, model, tok, stop_ids, ckpt)
                    spent["export"] = time.perf_counter() - t_export
            except KeyboardInterrupt:
                run.stop(flag)
                print("final eval or export interrupted: the checkpoint and metrics are committed without it")
            flag.immediate = False
            metrics = metrics_now(exported, final_eval)
            if ranks.main:
                runfiles.update_metrics(out, metrics)       # commit 2: with the final eval and the export
        trackers.end(metrics)
        if ranks.main:
            _plot(out / "loss.png", run.history, evals, src.spec)
    trainer.close()
    folders = [f for f in (exported or {}).values() if f]
    print(f"wrote {out / 'metrics.json'}, {ckpt}" + (f" and {' and '.join(folders)}" if folders else ""))
    print(wall_line(time.perf_counter() - t_start, load_s=setup_s, compile_s=compile_s, train_s=run.train_s,
                    limit_min=cfg.time_limit_min, **spent))
    ranks.close()
    return metrics


def wall_line(wall_s: float, *, load_s: float, compile_s: float, train_s: float, limit_min: float | None,
              evaluations: float, export: float) -> str:
    """Where the run's wall time went: the time limit counts the step loop (with its --eval-every evaluations)
    only, and this says what came on top."""
    def t(s: float) -> str:
        return f"{s / 60:.1f} min" if s >= 90 else f"{s:.0f} s"
    limit = f" (limit {limit_min:g} min)" if limit_min else ""
    parts = [f"model and data {t(load_s)}", f"compile {t(compile_s)}", f"training {t(train_s)}{limit}",
             f"evaluations {t(evaluations)} (those every --eval-every steps within training)"]
    if export:
        parts.append(f"export {t(export)}")
    return f"wall time {t(wall_s)}: " + ", ".join(parts)


def _say_start(cfg: FinetuneConfig, src: Source, data, batches, pad: dict, plan, *, n_params: int, dev: torch.device,
               param_dtype: str, load_s: float, compile_s: float) -> None:
    """What the run is about to do, on the console: model, examples, packing, plan."""
    where = f"cpu, {torch.get_num_threads()} threads" if dev.type == "cpu" else dev.type
    print(f"model {src.spec}: {n_params / 1e6:.1f} M parameters on {where} ({param_dtype}, loaded in {load_s:.0f} s); "
          f"{data.counts['train']} train / {len(data.eval)} eval examples, seq {data.seq_len}, "
          f"{'packed' if cfg.pack else 'one example a row'} (padding {pad['packed' if cfg.pack else 'unpacked']:.0%}"
          f", {'unpacked' if cfg.pack else 'packed'} it would be {pad['unpacked' if cfg.pack else 'packed']:.0%}); "
          f"{batches.steps_per_epoch} steps an epoch; plan: {plan.decisions.policy}, micro-batch {plan.micro_batch} x "
          f"{plan.n_micro}, compiled in {compile_s:.1f} s")
    if cfg.pack and pad["packed"] > pad["unpacked"]:
        print(f"note: --pack leaves more padding here ({pad['packed']:.0%}) than one example a row "
              f"({pad['unpacked']:.0%}): the examples are about as long as --seq {data.seq_len}; leave --pack out, "
              f"or give a longer --seq")
    if data.counts["too_long"]:
        print(f"{data.counts['too_long']} examples longer than {data.seq_len} tokens: "
              f"{data.counts['dropped']} dropped, the rest truncated (--truncate {cfg.truncate})")


def _metrics(cfg: FinetuneConfig, run: Progress, *, src: Source, model, n_params: int, dev: torch.device, hardware,
             param_dtype: str, data, batches, pad: dict, stop_ids: list[int], n_new: int, plan, compile_s: float,
             evals: list, prev: dict | None, t_start: float, ckpt: Path, exported: dict | None,
             final_eval: str) -> dict:
    """metrics.json of the run; ``final_eval``: pending (commit 1), done, or skipped (interrupted); ``exported``:
    the folders written (``export``: the model folder, merged for LoRA; ``adapter``: a LoRA run's adapter)."""
    return {
        "format": FORMAT,
        "settings": recorded(cfg),
        "model": {"source": src.spec, "kind": src.kind, "config": hf_config_dict(model)},
        "params": n_params, "device": dev.type, "threads": torch.get_num_threads(), "hardware": hardware,
        "param_dtype": param_dtype,
        "data": {**data.counts, "seq": data.seq_len, "fingerprint": data.fingerprint,
                 "steps_per_epoch": batches.steps_per_epoch, "padding": pad,
                 "stop_ids": stop_ids, "max_new_tokens": n_new},
        "plan": {"policy": plan.decisions.policy, "micro_batch": plan.micro_batch, "n_micro": plan.n_micro,
                 "packed": bool(plan.graph.meta.get("packed")),
                 "predicted_step_s": plan.predicted.get("step_time_s"), "compile_s": round(compile_s, 2)},
        "steps_done": run.step, "peak_lr": run.peak_lr, "tokens": run.tokens, "stop_reason": run.stop_reason,
        "interrupted": run.interrupted, "stopped_by": run.stopped_by, "final_eval": final_eval,
        "exact_match_before": next((e["exact_match"] for e in evals if e["step"] == 0), None),
        "exact_match": evals[-1]["exact_match"] if evals and final_eval == "done" else None,
        "eval_curve": evals, "loss_curve": run.history,
        "train_s": round(run.train_s + (prev["train_s"] if prev else 0.0), 2),
        "wall_s": round(time.perf_counter() - t_start, 2), "load_average": list(os.getloadavg()),
        "checkpoint": str(ckpt), "export": (exported or {}).get("model"), "adapter": (exported or {}).get("adapter"),
        "resumed_from": cfg.resume,
    }


def _inputs(cfg: FinetuneConfig, prev: dict | None, dev: torch.device, out: Path, *, main: bool = True,
            shard: bool = False):
    """The model's source, its tokenizer, the examples (encoded and checked against the model) and the
    model itself: (source, tokenizer, data, model, weights, stop ids, seconds to load the model).  A new
    run writes its source into ``OUTPUT/source/`` (``main``: rank 0 does); a resumed one refuses data files
    that changed.  ``shard`` (one of several ranks): the model is built on the meta device and ``weights`` gives
    only this rank's pieces (``shard_weights``) where the source allows; else ``weights`` is None (the model's
    own)."""
    src = _source(cfg, prev)
    lora_export.check_merge(cfg.merge and cfg.export, cfg.lora, src, getattr(cfg, "base_bits", 16))
    tok = tokenizer_for(src, cfg.tokenizer)
    if cfg.chat_template and prev is None:       # a resumed run's tokenizer (OUTPUT/source/) has it
        set_chat_template(tok, cfg.chat_template)
    enc = Encoder(tok, cfg.loss_on, name=f"the tokenizer of {cfg.tokenizer or src.spec}",
                  system_prompt=cfg.system_prompt)
    data = prepare_data(enc, cfg.data, cfg.eval_data, seq=cfg.seq, max_positions=max_positions(src.config),
                        truncate=cfg.truncate, eval_size=cfg.eval_size, columns=cfg.columns, workdir=out)
    if not cfg.evaluate:
        data.eval = []
    if prev is not None and prev["data"]["fingerprint"] != data.fingerprint:
        raise ValueError(f"--resume {cfg.resume}: the data files changed since the run started; start a new run")
    t = time.perf_counter()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if cfg.lora and shard:
        raise ValueError("--lora trains on one GPU (or the CPU): run it without --gpus / --nproc")
    model, weights = shard_weights(src, cfg.seed, dtype, resumed=prev is not None) if shard else (None, None)
    if model is None:
        model = build(src, cfg.seed, dtype)
    if cfg.lora:                # the adapters, seeded: a resumed run's are the checkpoint's
        torch.manual_seed(cfg.seed)
        model = wrap(model, parse_lora(cfg.lora))
    load_s = time.perf_counter() - t
    if (max_positions(model.config) or data.seq_len) < data.seq_len:
        raise ValueError(f"--seq {data.seq_len} is longer than the model's {max_positions(model.config)} positions")
    check_vocab(model, data, src.spec)
    stop_ids = enc.stop_ids(getattr(model, "generation_config", None))
    if prev is None and main:
        _write_source(out / "source", model, tok, stop_ids)
    return src, tok, data, model, weights, stop_ids, load_s


def shard_weights(src: Source, seed: int, dtype: torch.dtype, *, resumed: bool):
    """(model on the meta device, the weights of this rank's pieces) for one of several ranks, or (None, None)
    where the source must be built whole (``build``):

    - a resumed run: the checkpoint writes every element (``weights.CheckpointFilled``);
    - a safetensors folder (pretrained or named): each piece read by rows (``model_loading.shard_loadable``);
    - a config or a preset: its random weights computed a piece at a time, the values ``build`` draws
      (``random_init.RandomWeights``, from the same seed);
    - a GGUF file: built whole on every rank.  transformers' GGUF reader dequantizes every tensor into one state
      dict before it builds the model, and undoing llama.cpp's layout (tensor names, the q/k row permutation of
      Llama-family attention) per architecture is its code, not an interface; the trainer copies its shard and
      the rank keeps the model (``benchmarks/results/shard_load_rss.md`` measures what each rank holds).
    """
    if resumed:
        from ...runtime.weights import CheckpointFilled
        return build_model(str(src.path), device="meta", dtype=dtype), CheckpointFilled()
    if src.kind in ("named", "pretrained") and any(Path(src.path).glob("*.safetensors")):
        return shard_loadable(Path(src.path))
    if src.kind in ("config", "preset"):
        torch.manual_seed(seed)
        return random_init(str(src.path) if src.kind == "config" else src.spec, dtype=dtype)
    return None, None


def _export(cfg: FinetuneConfig, src: Source, param_dtype: str, folder: Path, trainer, model, tok,
            stop_ids: list[int], ckpt: Path) -> dict[str, str | None]:
    """The trained model as a Hugging Face folder: weights, config, tokenizer, generation config (with
    several ranks, rank 0 reads the weights from the checkpoint every rank just saved).  A LoRA run: the adapter as
    PEFT writes it in ``OUTPUT/adapter/`` with the tokenizer, and with ``--merge`` the merged model in ``folder``
    (``lora_export.py``).  Returns the folders written ({"model": ..., "adapter": ...})."""
    dtype = _export_dtype(cfg, src, param_dtype)
    if cfg.lora:
        return lora_export.export_run(folder.parent, spec=cfg.model, src=src, trainer=trainer, model=model,
                                      tokenizer=tok, generation_config=generation_config(model, stop_ids, tok),
                                      dtype=dtype, merge=cfg.merge)
    return {"model": str(write_folder(folder, trainer_weights(trainer, ckpt), config=hf_config_dict(model),
                                      dtype=dtype, tokenizer=tok,
                                      generation_config=generation_config(model, stop_ids, tok)))}


def hf_config_dict(model) -> dict:
    return hf_config(model.config, type(model).__name__)


def _source(cfg: FinetuneConfig, prev: dict | None) -> Source:
    """The model's source; a resumed run rebuilds it from the config it saved (its checkpoint holds every
    weight), with the tokenizer it saved; a resumed LoRA run from the model it started from (its checkpoint holds the
    adapters: the base is read again, and the checkpoint refuses one that changed)."""
    if prev is None or cfg.lora:
        return resolve(cfg.model)
    return Source(cfg.model, "config", Path(cfg.resume) / "source" / "config.json", str(Path(cfg.resume) / "source"),
                  None, prev["model"]["config"])


def _write_source(folder: Path, model, tok, stop_ids: list[int]) -> None:
    """Config, tokenizer and generation config of the run (for resume and ``lazytrain export``)."""
    with staged_folder(folder) as tmp:        # committed by renames: nothing written through a link in the run folder
        write_hf_json(tmp / "config.json", hf_config_dict(model))
        tok.save_pretrained(tmp)
        generation_config(model, stop_ids, tok).save_pretrained(tmp)


def _export_dtype(cfg: FinetuneConfig, src: Source, param_dtype: str) -> torch.dtype:
    name = cfg.export_dtype or (str(src.dtype).removeprefix("torch.") if src.dtype else param_dtype)
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise ValueError(f"--export-dtype {name}: not a floating dtype (float32, bfloat16, float16)")
    return dt


#: thread-count probing for fine-tuning steps: a pretrained model's CPU step takes seconds (SmolLM2-135M:
#: 11-100 s on the shared 2-core machine), so a probe is 3 timed steps after 1 to settle, not the task's 12
TUNER = {"probe": 3, "settle": 1, "every": 100}


def _fastest(tuner) -> int | None:
    """The thread count the tuner's last finished round measured fastest (None before one finished)."""
    if not tuner.history:
        return None
    medians = tuner.history[-1][1]
    return min(medians, key=medians.get)


def _plot(path: Path, history: list[dict], evals: list[dict], name: str) -> None:
    if not can_plot():
        say_no_plot("loss.png")
        return
    last = evals[-1] if evals else None
    title = f"fine-tuning {name}" + (f": exact match {last['exact_match']:.1%} at step {last['step']}"
                                     if last and last["exact_match"] is not None else "")
    plot_into(path, {"train loss": [(h["step"], h["loss"]) for h in history],
                     "eval loss": [(e["step"], e["eval_loss"]) for e in evals]}, title=title)
