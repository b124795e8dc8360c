"""Issue #43's workflow end to end, as a TRL user would run it: one YAML config (Hugging Face's keys) with
``KEY=VALUE`` overrides, a dataset file in another format with its own column names, TensorBoard logging read back,
checkpoints every N steps with a limit, and ``resume_from_checkpoint: true`` picking the newest complete one."""

import json

import pytest

pa = pytest.importorskip("pyarrow")
pytest.importorskip("tensorboard")

import pyarrow.csv as pacsv  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from ft_fixtures import tiny_folder  # noqa: E402
from test_data_files import save_to_disk  # noqa: E402

from lazytrain.app.cli import main  # noqa: E402

ROWS = [{"question": f"What is {i} plus {i % 7}?", "answer": str(i + i % 7), "id": i} for i in range(40)]


def _write(fmt: str, folder):
    """The rows as ``fmt``: a parquet file, a CSV file or a ``datasets`` save_to_disk folder."""
    if fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(ROWS), folder / "qa.parquet")
        return folder / "qa.parquet"
    if fmt == "csv":
        pacsv.write_csv(pa.Table.from_pylist(ROWS), folder / "qa.csv")
        return folder / "qa.csv"
    return save_to_disk(folder / "qa_dataset", [{k: str(v) for k, v in r.items()} for r in ROWS])


def _config(tmp_path, data, out, model) -> str:
    path = tmp_path / "sft.yaml"
    path.write_text(f"""
model_name_or_path: {model}
train_file: {data}
columns: {{question: instruction, answer: output}}
output_dir: {out}
per_device_train_batch_size: 2
gradient_accumulation_steps: 2
learning_rate: 1.0e-3
max_steps: 9
lr_scheduler_type: linear
warmup_ratio: 0.3
save_steps: 2
save_total_limit: 2
report_to: [tensorboard]
eval_size: 2
do_eval: true
time_limit_min: null
policy: keep-all
device: cpu
threads: 1
progress: false
export: false
""")
    return str(path)


@pytest.mark.parametrize("fmt", ["parquet", "csv", "datasets"])
def test_a_yaml_run_from_any_file_logs_saves_and_resumes_from_its_newest(tmp_path, fmt):
    model = tiny_folder(tmp_path / "hf")
    out = tmp_path / "run"
    cfg = _config(tmp_path, _write(fmt, tmp_path), out, model)

    class Killed(Exception):
        pass

    # the first run is killed after step 5 (an exception out of the step: nothing after it runs)
    from lazytrain.runtime import trainer as trainer_module
    real_step = trainer_module.Trainer.step

    def step(self, batch):
        if self.steps == 5:
            raise Killed
        return real_step(self, batch)
    trainer_module.Trainer.step = step
    try:
        with pytest.raises(Killed):
            main(["train", cfg, "max_steps=7"])          # an override of the file
    finally:
        trainer_module.Trainer.step = real_step
    kept = sorted(p.name for p in out.glob("checkpoint-*"))
    assert kept == ["checkpoint-2", "checkpoint-4"]       # save_total_limit: the newest two of 2, 4

    assert main(["train", cfg, "max_steps=7", "resume_from_checkpoint=true"]) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["steps_done"] == 7 and [h["step"] for h in m["loss_curve"]] == list(range(1, 8))
    s = m["settings"]
    assert (s["batch"], s["steps"], s["columns"]) == (4, 7, {"question": "instruction", "answer": "output"})
    assert m["data"]["train"] + m["data"]["eval"] == 40 and m["data"]["eval"] == 2
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    steps = sorted({e.step for e in events.Scalars("train/loss")})
    assert steps == list(range(1, 8))                     # the killed run's steps 1-5, the resumed 5-7
    lrs = {e.step: e.value for e in events.Scalars("train/learning_rate")}
    assert lrs[1] < lrs[2] == pytest.approx(1e-3)         # warm-up 0.3 x 7 = 2 steps, then the peak ...
    assert lrs[7] < lrs[3]                                 # ... and the linear decay
    assert "eval/exact_match" in events.Tags()["scalars"]
