"""gpipe.load_weights (gpipe/weights.py): a job's weights back into its model, each tied weight from its one stored
copy. A job is trained by the driver over stages on threads of this process (tests.support.local.drive), its
model.safetensors written by the product's own export (checkpoint.export_weights, as the driver does at a
job's end), and loaded into a fresh model: a nanoGPT-style model (`lm_head.weight` is `transformer.wte.weight`)
and Hugging Face's GPT-2. Then the refusals: one line, naming the tensor, the model left as it was."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F

import gpipe
from gpipe.coordinator.outputs import checkpoint
from tests.support.local import close_stages, drive, plan_of  # noqa: F401  # close_stages: a fixture
from tests.support.spec import GPT2, job

# -- a GPT in nanoGPT's style (karpathy/nanoGPT model.py, shrunk): its embedding is its head's weight ---------------


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd
        # nanoGPT's causal mask where flash attention is missing: a persistent buffer, so in the state dict
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, n_embd: int):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int = 97, block_size: int = 16, n_layer: int = 3, n_head: int = 2,
                 n_embd: int = 16):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([Block(n_embd, n_head, block_size) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # nanoGPT's weight tying

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def nano_gpt() -> GPT:
    return GPT()


NANO = job(GPT2, model={"factory": "tests.control.test_load_weights:nano_gpt", "args": {},
                        "split_points": ["transformer.h.1"]})


def trained(spec: dict, out: Path) -> Path:
    """Train `spec` (2 steps, a checkpoint at its end) under `out`, and write out/model.safetensors as a job does;
    the checkpoint's folder."""
    drive(plan_of({**spec, "steps": 2, "checkpoint_every": 2}), out)
    d = checkpoint.step_dir(checkpoint.folder(out), 2)
    checkpoint.export_weights(checkpoint.load(d), out / "model.safetensors", {"step": "1"})
    return d


def scrambled(model: nn.Module) -> nn.Module:
    """`model` with every parameter and buffer set to a value no training gives: what a load must overwrite."""
    with torch.no_grad():
        for t in model.state_dict().values():
            t.fill_(7)
    return model


def assert_loaded(model: nn.Module, want: dict[str, torch.Tensor], ties: dict[str, str]) -> None:
    """Every tensor of `model`'s state dict is `want`'s (a tied name's: its stored name's), bit for bit."""
    got = model.state_dict()
    assert set(want) == set(got) - set(ties)
    for name, t in got.items():
        assert torch.equal(t, want[ties.get(name, name)]), name


# -- round trips ---------------------------------------------------------------------------------------------------


def test_a_nanogpt_tie_loads_back_from_the_job_s_folder_and_its_checkpoints(tmp_path):
    d = trained(NANO, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert "transformer.wte.weight" in stored and "lm_head.weight" not in stored  # the tie once
    assert any(name.endswith("attn.bias") for name in stored)  # a buffer too
    with pytest.raises(RuntimeError, match='Missing key.*"lm_head.weight"'):
        nano_gpt().load_state_dict(stored)  # what docs/running.md said before: the issue
    want = checkpoint.load(d).model_state()
    assert all(torch.equal(stored[k], want[k]) for k in want) and set(stored) == set(want)
    ties = {"lm_head.weight": "transformer.wte.weight"}
    for path in (tmp_path, tmp_path / "model.safetensors", d, checkpoint.folder(tmp_path)):
        model = scrambled(nano_gpt())
        assert gpipe.load_weights(model, path) is model
        assert_loaded(model, want, ties)
        assert model.lm_head.weight is model.transformer.wte.weight  # still one tensor
        assert isinstance(model.lm_head.weight, nn.Parameter) and model.lm_head.weight.requires_grad


def test_a_hugging_face_gpt2_tie_loads_back_from_the_job_s_folder(tmp_path):
    pytest.importorskip("transformers")
    from tests.support import models

    d = trained(job(GPT2), tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert "transformer.wte.weight" in stored and "lm_head.weight" not in stored
    want = checkpoint.load(d).model_state()
    for path in (tmp_path, d):
        model = scrambled(models.gpt2())
        gpipe.load_weights(model, str(path))
        assert_loaded(model, want, {"lm_head.weight": "transformer.wte.weight"})
        assert model.lm_head.weight is model.transformer.wte.weight
        assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


def test_a_file_holding_a_tie_under_its_other_name_or_both_loads_and_two_values_are_refused(tmp_path):
    torch.manual_seed(0)
    src = nano_gpt()
    sd = {k: v.clone() for k, v in src.state_dict().items()}
    head = {k: v for k, v in sd.items() if k != "transformer.wte.weight"}  # the tie under lm_head.weight alone
    save_file(head, tmp_path / "head.safetensors")
    model = gpipe.load_weights(scrambled(nano_gpt()), tmp_path / "head.safetensors")
    assert_loaded(model, {k: v for k, v in sd.items() if k != "lm_head.weight"}, {"lm_head.weight": "transformer.wte.weight"})
    save_file(sd, tmp_path / "both.safetensors")  # both names, one value (two copies on disk)
    gpipe.load_weights(scrambled(nano_gpt()), tmp_path / "both.safetensors")
    save_file({**sd, "lm_head.weight": sd["lm_head.weight"] + 1}, tmp_path / "two.safetensors")
    with pytest.raises(ValueError, match="transformer.wte.weight and lm_head.weight are one tensor"):
        gpipe.load_weights(nano_gpt(), tmp_path / "two.safetensors")


def test_the_weights_land_on_the_model_s_device_and_dtype(tmp_path):
    model = nn.Sequential(nn.Linear(4, 3).to(torch.float64), nn.BatchNorm1d(3))
    sd = {k: torch.randn_like(v, dtype=v.dtype) if v.is_floating_point() else v + 5 for k, v in model.state_dict().items()}
    save_file(sd, tmp_path / "w.safetensors")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = scrambled(model.to(dev))
    gpipe.load_weights(model, tmp_path / "w.safetensors")
    for k, v in model.state_dict().items():
        assert v.device.type == dev and v.dtype == sd[k].dtype and torch.equal(v.cpu(), sd[k]), k


# -- refusals ------------------------------------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path) -> dict[str, torch.Tensor]:
    """A nanoGPT-style model's weights as a job's file holds them (the tie once)."""
    torch.manual_seed(1)
    return {k: v.clone() for k, v in nano_gpt().state_dict().items() if k != "lm_head.weight"}


BAD = {
    "a tensor missing": (lambda sd: sd.pop("transformer.ln_f.weight"),
                         r"does not fit the model: it has no transformer.ln_f.weight \(F32 \[16\]\)$"),
    "a tie missing under every name": (lambda sd: sd.pop("transformer.wte.weight"),
                                       r"it has no transformer.wte.weight \(nor under its tied name lm_head.weight\)"),
    "an unexpected tensor": (lambda sd: sd.update({"transformer.h.9.ln_1.weight": torch.ones(16)}),
                             r"it has transformer.h.9.ln_1.weight, which the model has no tensor for$"),
    "another shape": (lambda sd: sd.update({"transformer.wpe.weight": torch.zeros(8, 16)}),
                      r"it has F32 \[8, 16\] for transformer.wpe.weight, the model's is F32 \[16, 16\]$"),
    "another dtype": (lambda sd: sd.update({"transformer.h.0.attn.c_attn.bias": torch.zeros(48, dtype=torch.bfloat16)}),
                      r"it has BF16 \[48\] for transformer.h.0.attn.c_attn.bias, the model's is F32 \[48\]$"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_a_file_that_does_not_fit_is_refused_in_one_line_naming_the_tensor_and_nothing_is_changed(tmp_path, saved, case):
    edit, message = BAD[case]
    edit(saved)
    save_file(saved, tmp_path / "w.safetensors")
    model = scrambled(nano_gpt())
    with pytest.raises(ValueError, match=message) as e:
        gpipe.load_weights(model, tmp_path / "w.safetensors")
    assert "\n" not in str(e.value) and str(e.value).startswith(str(tmp_path / "w.safetensors"))
    assert all((t == 7).all() for t in model.state_dict().values())  # checked before anything was read


def test_a_pickle_is_refused_and_never_unpickled(tmp_path):
    marker = tmp_path / "unpickled"
    for name in ("model.safetensors", "w.pt"):  # torch.save's format is a pickle too
        (tmp_path / name).write_bytes(pickle.dumps(Boom(marker)))
    for path in (tmp_path, tmp_path / "w.pt"):
        with pytest.raises(ValueError, match="not a safetensors file") as e:
            gpipe.load_weights(nano_gpt(), path)
        assert "\n" not in str(e.value)
    assert not marker.exists()


class Boom:
    """An object whose unpickling makes a file: the proof that something was unpickled."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_damaged_checkpoint_an_unfinished_job_and_no_such_path_are_refused(tmp_path, saved):
    from gpipe.state import StageState

    snap = checkpoint.Snapshot(3, [StageState({f"model/{k}": v for k, v in saved.items()}, {})], {})
    d, _ = checkpoint.write(checkpoint.folder(tmp_path), snap)
    assert_loaded(gpipe.load_weights(scrambled(nano_gpt()), d), saved, {"lm_head.weight": "transformer.wte.weight"})
    with pytest.raises(ValueError, match=r"no model.safetensors \(the job has not finished\?\); its newest "
                                         r"checkpoint is .*step-3: load that"):
        gpipe.load_weights(nano_gpt(), tmp_path)
    f = d / checkpoint.shard_files(0)[0]
    f.write_bytes(f.read_bytes()[:-1] + bytes([f.read_bytes()[-1] ^ 1]))
    with pytest.raises(ValueError, match=r"stage-0.safetensors does not match the manifest"):
        gpipe.load_weights(nano_gpt(), d)
    m = json.loads((d / checkpoint.MANIFEST).read_text())
    (d / checkpoint.MANIFEST).write_text(json.dumps({**m, "format": 99}))
    with pytest.raises(ValueError, match="MANIFEST.json is not a manifest of ours"):
        gpipe.load_weights(nano_gpt(), d)
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        gpipe.load_weights(nano_gpt(), tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no model.safetensors, and no checkpoint of ours"):
        gpipe.load_weights(nano_gpt(), tmp_path / "empty")


def test_a_truncated_or_garbled_safetensors_file_is_refused(tmp_path, saved):
    save_file(saved, tmp_path / "w.safetensors")
    raw = (tmp_path / "w.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(raw[:-4])
    (tmp_path / "tiny.safetensors").write_bytes(raw[:5])
    (tmp_path / "head.safetensors").write_bytes((10**9).to_bytes(8, "little") + raw[8:])
    for name, why in (("cut", r"transformer.wte.weight: F32 \[97, 16\] at bytes \d+\.\.\d+ of \d+"), ("tiny", "shorter than a header"),
                      ("head", "a header of 1000000000 bytes")):
        with pytest.raises(ValueError, match=f"not a safetensors file \\({why}"):
            gpipe.load_weights(nano_gpt(), tmp_path / f"{name}.safetensors")


class Fused(nn.Module):
    """torchtitan's FusedQKVLinear's state dict hooks, on one weight: `wqkv` saved as `wq`, `wk` (copies)."""

    def __init__(self) -> None:
        super().__init__()
        self.wqkv = nn.Linear(4, 8, bias=False)
        self.register_state_dict_post_hook(self._split)
        self.register_load_state_dict_pre_hook(self._merge)

    @staticmethod
    def _split(module, state_dict, prefix, local_metadata):
        w = state_dict.pop(f"{prefix}wqkv.weight")
        state_dict[f"{prefix}wq.weight"] = w[:4].contiguous()
        state_dict[f"{prefix}wk.weight"] = w[4:].contiguous()

    @staticmethod
    def _merge(module, state_dict, prefix, *args):
        if f"{prefix}wq.weight" in state_dict:
            state_dict[f"{prefix}wqkv.weight"] = torch.cat(
                [state_dict.pop(f"{prefix}wq.weight"), state_dict.pop(f"{prefix}wk.weight")])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wqkv(x)


def fused_model() -> nn.Sequential:
    return nn.Sequential(Fused(), nn.Linear(8, 2))


def test_a_weight_a_state_dict_hook_renames_loads_by_its_parameter_name(tmp_path):
    trained = fused_model()
    own = {n: p.detach() + 1 for n, p in trained.named_parameters()}  # as the job's model.safetensors names them
    save_file(own, tmp_path / "model.safetensors")
    fresh = gpipe.load_weights(fused_model(), tmp_path)
    for n, p in fresh.named_parameters():
        assert torch.equal(p, own[n]), n


def test_a_file_of_the_hooks_names_is_refused_not_loaded_into_their_copies(tmp_path):
    trained = fused_model()
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(1)
    save_file(trained.state_dict(), tmp_path / "sd.safetensors")  # 0.wq.weight, 0.wk.weight: the hooks' names
    fresh = fused_model()
    before = {n: p.detach().clone() for n, p in fresh.named_parameters()}
    with pytest.raises(ValueError, match=r"has no 0\.wqkv\.weight .*load it with model\.load_state_dict"):
        gpipe.load_weights(fresh, tmp_path / "sd.safetensors")
    for n, p in fresh.named_parameters():  # nothing changed
        assert torch.equal(p, before[n]), n
