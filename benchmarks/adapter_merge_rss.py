"""Peak host memory of merging a LoRA adapter into a base folder (``hf.adapter_export.merge_into_folder``) against
the base's size: the merge reads one weight at a time and holds one output shard, never a second copy.

    python benchmarks/adapter_merge_rss.py --layers 8 --hidden 1024 --shard-mb 100

Each merge runs in a fresh process (peak RSS is per process: ``VmHWM``); the base is a random fp32 Llama saved
in shards, the adapter r=16 on all seven linear layers of every block, random (B nonzero).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make(folder: Path, layers: int, hidden: int) -> None:
    import torch
    import transformers
    from safetensors.torch import save_file
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                                   num_attention_heads=hidden // 64, num_key_value_heads=hidden // 256,
                                   vocab_size=32000, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    model.save_pretrained(folder / "base", max_shard_size="100MB")      # a sharded base folder
    adapter = {}
    for name, mod in model.named_modules():
        if name.rsplit(".", 1)[-1] in TARGETS:
            key = f"base_model.model.{name}"
            adapter[f"{key}.lora_A.weight"] = torch.randn(16, mod.in_features) * 0.01
            adapter[f"{key}.lora_B.weight"] = torch.randn(mod.out_features, 16) * 0.01
    save_file(adapter, str(folder / "adapter.safetensors"))
    n = sum(p.numel() for p in model.parameters())
    (folder / "facts.json").write_text(json.dumps({"params": n, "layers": layers, "hidden": hidden}))


def merge(folder: Path, shard_mb: int) -> None:
    import torch
    from peft import LoraConfig
    from safetensors import safe_open
    from safetensors.torch import load_file

    from lazytrain.hf.adapter_export import merge_into_folder
    from lazytrain.measure.bench_worker import host_peak_rss_bytes, host_rss_bytes
    adapter = load_file(str(folder / "adapter.safetensors"))
    after_imports = host_rss_bytes()
    config = LoraConfig(r=16, lora_alpha=32, target_modules=list(TARGETS))
    out = merge_into_folder(folder / "merged", folder / "base", adapter, config, torch.float32,
                            max_shard_bytes=shard_mb * 10**6)
    peak = host_peak_rss_bytes()
    key = "model.layers.0.mlp.down_proj.weight"            # one merged weight, checked against W + 2 * B @ A
    index = json.loads((folder / "base" / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(folder / "base" / index[key]), "pt") as f:
        w = f.get_tensor(key)
    out_index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(out / out_index[key]), "pt") as f:
        got = f.get_tensor(key)
    a, b = adapter[f"base_model.model.{key[:-7]}.lora_A.weight"], adapter[f"base_model.model.{key[:-7]}.lora_B.weight"]
    err = (got - (w + 2.0 * b @ a)).abs().max().item()
    print(json.dumps({"after_imports": after_imports, "peak": peak, "max_err": err,
                      "out_shards": len(set(out_index.values()))}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--shard-mb", type=int, default=100, help="output shard size (MB); the base has 100 MB shards")
    ap.add_argument("--phase", choices=("make", "merge"), help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase == "make":
        return make(Path(args.dir), args.layers, args.hidden)
    if args.phase == "merge":
        return merge(Path(args.dir), args.shard_mb)
    with tempfile.TemporaryDirectory() as tmp:
        common = [sys.executable, __file__, "--dir", tmp, "--layers", str(args.layers), "--hidden", str(args.hidden),
                  "--shard-mb", str(args.shard_mb)]
        subprocess.run([*common, "--phase", "make"], check=True)
        facts = json.loads((Path(tmp) / "facts.json").read_text())
        base = sum(p.stat().st_size for p in (Path(tmp) / "base").glob("*.safetensors"))
        shards = len(list((Path(tmp) / "base").glob("*.safetensors")))
        r = json.loads(subprocess.run([*common, "--phase", "merge"], check=True, capture_output=True,
                                      text=True).stdout.strip().splitlines()[-1])
    mib = 2**20
    print(f"Llama shape, {facts['layers']} layers, hidden {facts['hidden']}: {facts['params'] / 1e6:.1f} M parameters, "
          f"fp32 base {base / mib:.0f} MiB in {shards} shards; adapter r=16 on {', '.join(TARGETS)}; "
          f"output shards of {args.shard_mb} MB ({r['out_shards']} files)\n")
    print("| base on disk (MiB) | RSS after imports and the adapter (MiB) | peak RSS of the merge (MiB) "
          "| peak above imports (MiB) | peak above imports / base | max abs error of one merged weight |")
    print("| --- | --- | --- | --- | --- | --- |")
    print(f"| {base / mib:.0f} | {r['after_imports'] / mib:.0f} | {r['peak'] / mib:.0f} | "
          f"{(r['peak'] - r['after_imports']) / mib:.0f} | {(r['peak'] - r['after_imports']) / base:.2f} | "
          f"{r['max_err']:.1e} |")


if __name__ == "__main__":
    main()
