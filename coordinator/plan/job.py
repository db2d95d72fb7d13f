"""The plan of a job: the model, its cut into stages, and the data, checked before any worker starts.

Everything here that can fail because of the spec raises SpecError naming the
field, so a bad job never reaches a worker.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from torch import nn
from torch.utils.data import Dataset

from gpipe import balance, batchnorm, cuts, measured, optim, optim_check, schedule, weight_init
from gpipe.capture import graph as capture
from gpipe.capture import skeleton
from gpipe.coordinator.plan.data import DataStream, EvalStream
from gpipe.coordinator.plan.pretrained import Pretrained, match, open_weights
from gpipe.coordinator.plan.probe_cache import Probes
from gpipe.coordinator.spec.job import JobSpec, format_validation_error
from gpipe.data.tokens import TokenWindows, vocabulary
from gpipe.errors import SpecError, describe_os_error
from gpipe.eval_schedule import EvalSchedule
from gpipe.factory import add_import_paths, resolve
from gpipe.memory import footprint
from gpipe.memory.probe import probe, probe_eval
from gpipe.precision import unsupported
from gpipe.show import first_line
from gpipe.weight_init import uninitialisable
from gpipe.wire import backend_of, encode


@dataclass
class Plan:
    spec: JobSpec
    model: nn.Sequential  # exact: the initial weights (torch.manual_seed(seed); factory(**args)); per_layer: on meta
    balance: list[int]  # layers per stage (per model chunk, with virtual stages)
    dataset: Dataset[Any]
    import_paths: list[str]
    balance_costs: list[float] | None = None  # per layer, when the balance was computed
    balance_by: str = "spec"  # "spec", the method that computed it (by_params, ...), or "checkpoint"
    collate: Callable[[list[Any]], Any] | None = None  # data.collate; none: torch's default_collate
    skips: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (stashing, popping layer)
    eval_dataset: Dataset[Any] | None = None  # eval.data, when the job evaluates
    eval_collate: Callable[[list[Any]], Any] | None = None
    evaluate_only: bool = False  # the eval verb: one evaluation of the model's weights, before any step
    # The model's own loss: (the keyword it takes the targets by, the name of its first input where a micro-batch's
    # input is one tensor): the data streams hand the model its targets (gpipe.coordinator.plan.data).
    targets_into: tuple[str, str] | None = None
    captured: capture.Captured | None = None  # a model that is not an nn.Sequential: its pieces are `model`
    sample: dict[str, Any] | None = None  # then: the first micro-batch's signature, which the stages capture with
    original: nn.Module | None = None  # then: the model as the factory returned it
    auto: dict[str, Any] | None = None  # the spec's auto values as chosen (gpipe.coordinator.plan.search.resolve): plan.json
    predicted_step_s: float | None = None  # the step time predicted (gpipe.coordinator.plan.search.predict_step)
    predicted_step_missing: str = ""  # why not, when it is None
    weights: Pretrained | None = None  # model.weights: the pretrained checkpoint the stages start from
    weights_at: dict[str, tuple[int, str]] = field(default_factory=dict)  # model name -> (its file, name there)
    # Built on the meta device (model.weights, init per_layer: gpipe.capture.skeleton): its buffers' values, by the
    # model's names; empty when the model was built whole.
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    on_meta: bool = False  # whether `model` was built on the meta device (it then holds no weights)
    # What each layer keeps for its backward, measured on the first micro-batch (gpipe.memory.footprint): the memory
    # balance and each worker's predicted peak (gpipe.coordinator.plan.prediction) read it. None without, and why.
    footprint: footprint.Footprint | None = None
    footprint_missing: str = ""
    state_slots: int = 0  # the optimizer's state tensors per parameter (gpipe.optim_check measures one by import path)
    # The probes' answers: measured, or kept from an earlier plan of the unchanged job (gpipe.coordinator.plan.probe_cache).
    probes: Probes = field(default_factory=Probes.off)
    _packed: dict[tuple[int, int], bytes | None] = field(default_factory=dict, init=False, repr=False,
                                                         compare=False)  # stage_pieces, by pieces' range

    def capture_args(self) -> dict[str, Any] | None:
        """What a stage captures the model with (StageConfig.capture); None for an nn.Sequential."""
        if self.captured is None:
            return None
        m = self.spec.model
        return {"split_points": list(m.split_points or []), "output": self.spec.model_output, "sample": self.sample}

    def stage_pieces(self, model_chunk: int) -> bytes | None:
        """The captured pieces of model chunk `model_chunk`, without weights, for its stages to build from
        (StageConfig.pieces, gpipe.capture.skeleton.pack; made once, every replica's stage takes them). None, and
        the stages capture the model themselves: for an nn.Sequential; with init per_layer on a model built whole
        here (one the meta device could not stand for: a constant its forward makes would come to no stage, which
        gets no weights); where the pieces do not pickle."""
        if self.captured is None or (self.spec.init == "per_layer" and not self.on_meta):
            return None
        bounds = self.bounds[model_chunk]
        if bounds not in self._packed:
            try:
                self._packed[bounds] = skeleton.pack(self.model, *bounds)
            except Exception:
                self._packed[bounds] = None
        return self._packed[bounds]

    def weight_name(self, key: str) -> str:
        """A weight's name in checkpoints and model.safetensors: the model's own (a captured model's pieces
        hold them under "piece.name")."""
        return capture.model_name(key) if self.captured is not None else key

    def write_config(self, out: Path) -> None:
        """A Hugging Face model's config.json beside model.safetensors, so that from_pretrained(out) loads it."""
        config = getattr(self.original, "config", None)
        if config is not None and callable(getattr(config, "to_json_file", None)):
            from gpipe.files import atomic_write

            atomic_write(out / "config.json", lambda tmp: config.to_json_file(str(tmp)))

    def summary(self) -> str:
        """What the model was cut into and how the stages share it, each count named (validate's first line):
        "4 layers, balance [2, 2]" (an nn.Sequential: balance in layers); "4 blocks in layers (TransformerBlock),
        4 pieces, balance [2, 2]" or "no repeated blocks, 1 split point, 2 pieces, balance [1, 1]" (a captured
        model: balance in pieces)."""
        if self.captured is None:
            return f"{len(self.model)} layers, balance {self.balance}"
        return f"{self.captured.what()}, balance {self.balance}"

    def cut_lines(self) -> list[str]:
        """What crosses each cut between stages, as the sample gave it (a captured model's; none for an
        nn.Sequential, whose probe checks each cut): "cut 1 (before transformer.h.2): [B, T, 64] float32 ..."."""
        c = self.captured
        if c is None:
            return []
        out = []
        for k, (start, _) in enumerate(self.bounds[1:], 1):
            first = c.modules[start][0] if c.modules[start] else f"piece {start}"
            out.append(f"cut {k} (before {first}): {'; '.join(c.shapes[start - 1])}")
        return out

    def stage_modules(self, model_chunk: int) -> list[str]:
        """The model's modules the stage of model chunk `model_chunk` runs, the outermost of them (an
        nn.Sequential's: its layers)."""
        start, end = self.bounds[model_chunk]
        if self.captured is None:
            return [f"{i} ({type(self.model[i]).__name__})" for i in range(start, end)]
        return [m for i in range(start, end) for m in self.captured.modules[i]]

    def stage_parameters(self, model_chunk: int) -> int:
        """The parameters the stage of model chunk `model_chunk` holds (a tied weight counted on each stage that
        holds a copy)."""
        start, end = self.bounds[model_chunk]
        return sum(p.numel() for p in nn.ModuleList(self.model[i] for i in range(start, end)).parameters())

    def tied_stages(self) -> list[tuple[list[str], list[int]]]:
        """Per tied weight: its keys, and the stages holding a copy (StageConfig.tied)."""
        if self.captured is None:
            return []
        return [(keys, cuts.holders(keys, self.balance)) for keys in self.captured.tied]

    def eval_stream(self) -> EvalStream:
        """The job's evaluation data (gpipe.coordinator.plan.data); only for a job with an eval section."""
        e = self.spec.eval
        assert e is not None and self.eval_dataset is not None
        return EvalStream(self.eval_dataset, e.data.batch_size, self.spec.chunks, e.batches, self.eval_collate,
                          self.targets_into)

    def eval_schedule(self) -> EvalSchedule:
        """When the stages evaluate, and how many batches (none without an eval section)."""
        e = self.spec.eval
        if e is None:
            return EvalSchedule(None, 0, self.spec.steps)
        if self.evaluate_only:
            return EvalSchedule(None, self.eval_stream().batches, 0)
        return EvalSchedule(e.every, self.eval_stream().batches, self.spec.steps)

    def stream(self) -> DataStream:
        """The job's data stream (gpipe.coordinator.plan.data)."""
        d = self.spec.data
        return DataStream(self.dataset, d.batch_size, self.spec.chunks, d.shuffle, self.spec.seed, self.collate,
                          self.spec.replicas, self.targets_into)

    def skip_routes(self) -> list[cuts.Route]:
        """(name, stashing stage, popping stage) of each skip connection that leaves its stage (gpipe.cuts)."""
        return cuts.routes(self.skips, self.balance)

    @property
    def bounds(self) -> list[tuple[int, int]]:
        """[start, end) layer range of each stage (gpipe.cuts)."""
        return cuts.bounds(self.balance)

    def stage_state(self, model_chunk: int) -> dict[str, torch.Tensor]:
        """The initial parameters and buffers of the stage of model chunk `model_chunk`, under the full model's
        names."""
        start, end = self.bounds[model_chunk]
        keep = {str(i) for i in range(start, end)}
        own = dict(self.model.named_parameters(remove_duplicate=False)) | dict(self.model.named_buffers(remove_duplicate=False))
        out = {k: v.detach() for k, v in own.items() if k.split(".", 1)[0] in keep}
        if self.buffers:  # built on the meta device: the buffers as the model built them
            out |= {k: self.buffers[n] for k in out if (n := self.weight_name(k)) in self.buffers}
        return out


def _call(field: str, ref: str, args: dict[str, Any]) -> Any:
    try:
        fn = resolve(ref)
    except LookupError as e:
        raise SpecError(f"{field}.factory: {e}") from None
    try:
        return fn(**args)
    except Exception as e:
        raise SpecError(f"{field}.args: {ref} raised {type(e).__name__}: {e}") from None


def optimizer_slots(spec: JobSpec) -> int:
    """The optimizer's state tensors per parameter; one by import path is checked first (gpipe.optim_check:
    imported from the job's code, its options bound, two steps on a dummy parameter)."""
    o = spec.optimizer
    if not o.by_path:
        return optim.state_slots(o.name, o.momentum)
    try:
        return optim_check.check(o.name, o.torch_kwargs())
    except optim_check.OptimizerError as e:
        raise SpecError(f"optimizer.{e}") from None


def make_plan(spec: JobSpec, job_dir: Path, device: str = "cpu", threads: int = 1,
              balance_of: list[int] | None = None, meta: bool | None = None, probes: Probes | None = None) -> Plan:
    """Build the model and the data, check them against the spec, and choose the balance.

    `device` and `threads` are those of the stages: by_time measures layers there.
    `balance_of` is a balance chosen before (a resumed job's checkpoint's): a
    computed balance keeps it when it still fits (the same stages and layers),
    so a resumed job is cut as before; a balance given in the spec wins.

    With model.weights or init per_layer, the model is built and captured on the meta device (`meta`: None);
    no weights are made here. A model that needs what that cannot give (an nn.Sequential the probe runs, a
    captured forward that makes a tensor constant) is built whole instead, with model.weights (meta false).

    `probes`: the answers an earlier plan of the unchanged job kept (the probe, the footprint, the balance's
    costs), taken instead of running the model again; none by default.
    """
    probes = probes or Probes.off()
    if why := unsupported(spec.precision, spec.device):
        raise SpecError(f"precision: {why}")
    spec = table_from_file(spec, job_dir)
    pretrained = _open_weights(spec, job_dir)  # a file that cannot be read is refused before the model is built
    import_paths = [str(job_dir.resolve())]
    add_import_paths(import_paths)
    slots = optimizer_slots(spec)  # before the model: a bad option answers at once
    model, buffers = _build_model(spec, meta)
    if isinstance(model, nn.Sequential) and buffers is not None and spec.probe and spec.init == "exact":
        model, buffers = _build_model(spec, meta=False)  # the probe runs an nn.Sequential for real
    if not isinstance(model, nn.Module):
        raise SpecError(f"model.factory: returned {type(model).__name__}, expected a torch.nn.Module")
    if isinstance(model, nn.Sequential) and (spec.model.split_points or spec.model.output):
        raise SpecError("model.split_points: an nn.Sequential is cut between its layers by balance; "
                        "leave split_points and output out")
    if spec.replicas > 1 and not spec.deferred_batch_norm and \
            (name := batchnorm.per_replica(model, sync_across_processes=True)) is not None:
        raise SpecError(f"replicas: {spec.replicas} replicas need deferred_batch_norm: true for the BatchNorm at "
                        f"{name}: its running statistics are then the whole batch's, once a step, on every replica")
    dataset, _ = _dataset("data", spec.data.factory, spec.data.args)
    try:
        loss_fn = resolve(spec.loss_function)
    except LookupError as e:
        raise SpecError(f"loss: {e}") from None
    into = _targets_into(spec, model)
    collate = _collate("data", spec.data.collate)
    stream = DataStream(dataset, spec.data.batch_size, spec.chunks, spec.data.shuffle, spec.seed, collate,
                        spec.replicas, into)
    try:
        xs, ys, _ = stream.shards(0)[0]
    except Exception as e:
        raise SpecError(f"data: the first batch: {first_line(e)}") from None
    _check_vocabulary("data", spec.data.factory, dataset, stream.indices(0), model)
    original, captured, sample = None, None, None
    if not isinstance(model, nn.Sequential):
        original, sample = model, capture.sample_signature(xs[0])
        try:
            captured = skeleton.capture_pieces(model, {"split_points": spec.model.split_points,
                                                       "output": spec.model_output, "sample": sample})
        except (capture.CaptureError, ValueError, TypeError) as e:
            if buffers is not None:  # on the meta device (a plain tensor the model keeps): as the stages do, whole
                return make_plan(spec, job_dir, device, threads, balance_of, meta=False, probes=probes)
            raise SpecError(str(e) if isinstance(e, capture.CaptureError) else f"model: {first_line(e)}") from None
        model = captured.pieces
        if spec.init == "per_layer" and spec.init_hook is None:
            if (what := weight_init.unresettable(original, captured.pieces)) is not None:
                raise SpecError(f"init: {what} has parameters but no reset_parameters(); give init_hook")
        if buffers is not None and (gap := skeleton.unknown_constant(model, buffers)) is not None:
            if spec.init == "per_layer":
                raise SpecError(f"init: per_layer: the captured forward makes a tensor constant ({gap}) that a "
                                "model built on the meta device does not hold; use init exact")
            return make_plan(spec, job_dir, device, threads, balance_of, meta=False, probes=probes)  # model.weights: built whole
    layers = len(model)
    what = "layers" if captured is None else f"blocks ({captured.blocks})" if captured.blocks else "pieces"
    cut = f"{spec.stages} stages" if spec.virtual_stages == 1 else \
        f"{spec.stages} stages x {spec.virtual_stages} virtual_stages"
    if why := cuts.shortfall(spec.model_chunks, layers, cut, what):
        raise SpecError(why)
    backend = backend_of(spec.device)  # what carries the cuts: their dtypes are checked against it
    probes.bind((xs[0], ys[0]), spec, buffers is not None)
    skips = probes.answer("skips", lambda: probe(model, xs[0], ys[0], loss_fn, backend), dict[str, tuple[int, int]]) \
        if spec.probe and captured is None else {}
    if captured is not None and spec.probe:
        probes.answer("pieces", lambda: _passes(_probe_captured, model, xs[0], ys[0], loss_fn, backend, captured.modules))
    fits = balance_of is not None and len(balance_of) == spec.model_chunks and sum(balance_of) == layers
    # Also without the probe on the meta device (init per_layer, model.weights), where it costs no memory.
    fp, missing = probes.answer("footprint", lambda: _footprint(spec, model, xs[0], ys[0], loss_fn),
                                tuple[footprint.Footprint | None, str], keep=lambda got: got[0] is not None) \
        if spec.probe or spec.balance == "by_memory" or buffers is not None else (None, "probe: false")
    if captured is not None and spec.model.split_points:
        balance, costs, by = capture.balance_of_cuts(captured.cuts, layers), None, "spec"
    elif isinstance(spec.balance, str) and fits:
        balance, costs, by = list(balance_of), None, "checkpoint"  # type: ignore[arg-type]  # balance_by names the spec's choices, and this one
    else:
        balance, costs = probes.answer("balance", lambda: _balance(spec, model, xs[0], torch.device(device), threads,
                                                                   fp, slots), tuple[list[int], list[float] | None])
        by = spec.balance if isinstance(spec.balance, str) else "spec"
    shared = _shared_parameters(model, balance) if captured is None else None
    if shared:
        raise SpecError(f"model.factory: {shared}; stages cannot share parameters")
    plan = Plan(spec, model, balance, dataset, import_paths, costs, by, collate, skips,
                captured=captured, sample=sample, original=original, buffers=buffers or {},
                on_meta=buffers is not None, footprint=fp, footprint_missing=missing, state_slots=slots,
                targets_into=into, probes=probes)
    if pretrained is not None:
        _match_weights(plan, pretrained)
    if spec.eval is not None:
        _plan_eval(plan, loss_fn)
    return plan


def table_from_file(spec: JobSpec, job_dir: Path) -> JobSpec:
    """`schedule: {file: PATH}`: the spec with that file's table of actions as its schedule (gpipe.measured.read_table:
    a CSV, or a measured job's plan.json; checked whole, then against the job's stages, virtual_stages and
    chunks), the path relative to `job_dir`; SpecError naming the row. Any other spec as it is."""
    if not schedule.is_file(spec.schedule):
        return spec
    given = spec.schedule[len(schedule.FILE):]
    try:
        with (job_dir / given).open("rb") as f:
            raw = f.read(measured.MAX_CSV_BYTES + 1)
    except OSError as e:
        raise SpecError(f"schedule: {describe_os_error(e, 'reading')}") from None
    if len(raw) > measured.MAX_CSV_BYTES:
        raise SpecError(f"schedule: {given}: over the {measured.MAX_CSV_BYTES >> 20} MiB a table may have")
    try:
        orders = measured.read_table(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise SpecError(f"schedule: {given}: not UTF-8 text (byte {e.start})") from None
    except measured.TableError as e:
        raise SpecError(f"schedule: {given}: {e}") from None
    data = spec.model_dump(mode="json", exclude_unset=True)
    data["schedule"] = schedule.table(orders)
    try:
        return JobSpec.model_validate(data)
    except ValidationError as e:
        raise SpecError(f"{format_validation_error(e)} (schedule: {given})") from None


def _passes(check: Callable[..., None], *args: Any) -> bool:
    """True once `check(*args)` returned (a probe that raises when the job fails it): the answer probes.json keeps."""
    check(*args)
    return True


def _targets_into(spec: JobSpec, model: nn.Module) -> tuple[str, str] | None:
    """With the model's own loss: (the keyword the model takes the targets by, its first input's name, which a
    micro-batch's input that is one tensor is given as); None with a loss function. SpecError for an
    nn.Sequential, which takes one input."""
    keyword = spec.loss_keyword
    if keyword is None:
        return None
    if isinstance(model, nn.Sequential):
        raise SpecError("loss: the model's own loss needs a model that takes its targets (a forward with "
                        f"{keyword}=...); an nn.Sequential takes one input: give a loss function")
    params = [p for p in inspect.signature(model.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    takes_any = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(model.forward).parameters.values())
    if keyword not in {p.name for p in params} and not takes_any:
        names = ", ".join(p.name for p in params) or "none"
        raise SpecError(f"loss: {type(model).__name__}.forward takes no {keyword!r} (its inputs: {names}); name "
                        "the keyword it takes the targets by: loss: {from_model: KEYWORD}")
    first = next((p.name for p in params if p.name != keyword), keyword)
    return keyword, first


def _open_weights(spec: JobSpec, job_dir: Path) -> Pretrained | None:
    """model.weights, its files' headers read (relative to the job's folder, `job_dir`); None without it."""
    if spec.model.weights is None:
        return None
    path = Path(spec.model.weights).expanduser()
    return open_weights(path if path.is_absolute() else job_dir / path)


def _match_weights(plan: Plan, pretrained: Pretrained) -> None:
    """Find each of the model's tensors in model.weights, by the model's names. A Hugging Face model's are also
    found as its own checkpoints may name them: without its base model's prefix (`transformer.` of GPT-2's head
    model), and the names it ignores on loading (`_keys_to_ignore_on_load_unexpected`: an old GPT-2's
    attn.bias masks) are let be."""
    plan.weights = pretrained
    want = {plan.weight_name(k): t for k, t in plan.model.state_dict(keep_vars=True).items()}
    aliases: dict[str, list[str]] = {}
    ignore: list[str] = []
    if plan.original is not None:  # a tied weight's other names: the file may hold it under any one
        by_id: dict[int, list[str]] = {}
        for name, p in plan.original.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(p), []).append(name)
        aliases = {names[0]: names[1:] for names in by_id.values() if len(names) > 1}
        prefix = getattr(plan.original, "base_model_prefix", None)
        if isinstance(prefix, str) and prefix:
            for name in want:
                if name.startswith(prefix + "."):
                    aliases.setdefault(name, []).append(name.removeprefix(prefix + "."))
        patterns = getattr(plan.original, "_keys_to_ignore_on_load_unexpected", None)
        ignore = [p for p in patterns or [] if isinstance(p, str)]
    plan.weights_at = match(pretrained, want, aliases, ignore=ignore)


def _probe_captured(pieces: nn.Sequential, x: Any, y: Any, loss_fn: Callable[[Any, Any], Any], backend: str,
                    modules: list[list[str]]) -> None:
    """The first samples of the first micro-batch through the pieces and the loss, changing nothing: a model
    whose capture does not run, whose output the loss cannot take, or that sends between its pieces what
    cannot cross a cut over `backend` (a dtype it does not carry), is refused before any worker starts."""
    from gpipe import structure

    meta = any(t.is_meta for t in pieces.parameters())  # built on the meta device: the probe runs there too
    x, y = (structure.map_tensors(v, lambda t: t[:2].to("meta") if meta else t[:2]) for v in (x, y))
    buffers = [(b, b.clone()) for b in pieces.buffers()]
    try:
        with torch.random.fork_rng():
            out = x
            for k, piece in enumerate(pieces):
                out = piece(out)
                if k < len(pieces) - 1:  # what crosses to piece k+1, where a stage may end
                    try:
                        encode(0, out, (), backend)
                    except ValueError as e:
                        before = modules[k + 1][0] if modules[k + 1] else f"piece {k + 1}"
                        raise SpecError(f"model: the cut before {before} (piece {k + 1}) would carry "
                                        f"{structure.describe(out)}: {e}") from None
            try:
                loss = loss_fn(out, y)
            except Exception as e:  # the loss's own failure: named as the loss's, not the model's
                raise SpecError(f"loss: on the model's output {structure.describe(out)} and the targets "
                                f"{structure.describe(y)}: {first_line(e)}") from None
            loss.backward()
    except SpecError:
        raise
    except Exception as e:
        raise SpecError(f"model: the captured model on the first micro-batch: {first_line(e)}") from None
    finally:
        pieces.zero_grad(set_to_none=True)
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


def _dataset(field: str, factory: str, args: dict[str, Any]) -> tuple[Dataset[Any], int]:
    """The data set `field` names, and its length: map-style, not empty, of (input, target) pairs."""
    dataset = _call(field, factory, args)
    try:
        n = len(dataset)
    except TypeError:
        raise SpecError(f"{field}.factory: returned {type(dataset).__name__}, expected a map-style Dataset") from None
    if n == 0:
        raise SpecError(f"{field}.factory: the data set is empty")
    item = dataset[0]
    if not (isinstance(item, tuple | list) and len(item) == 2):
        raise SpecError(f"{field}.factory: item 0 is a {type(item).__name__}, expected an (input, target) pair")
    return dataset, n


def _check_vocabulary(field: str, factory: str, dataset: Dataset[Any], items: Sequence[int],
                      model: nn.Module) -> None:
    """Token windows (gpipe.data.tokens: the tokens and hf_dataset sources) whose first batch, items `items`, holds
    an id the model's embedding has no row for: SpecError saying which id, where, the vocabulary and the dtype the
    files were read as (the model would fail on it as IndexError: index out of range in self). Nothing is
    checked where the model's vocabulary cannot be told (no nn.Embedding) or the data set is another's."""
    if not isinstance(dataset, TokenWindows) or (found := vocabulary(model)) is None:
        return
    vocab, embedding = found
    if (bad := dataset.out_of_vocabulary(items, vocab)) is not None:
        dtype = f"{field}.args.dtype the one `tokenize` printed, and " if factory == "tokens" else ""
        raise SpecError(f"{field}: the first batch's {bad} ({embedding}): is {dtype}the model's vocabulary the "
                        "tokenizer's?")


def _collate(field: str, ref: str | None) -> Callable[[list[Any]], Any] | None:
    if ref is None:
        return None
    try:
        return resolve(ref)
    except LookupError as e:
        raise SpecError(f"{field}.collate: {e}") from None


def _plan_eval(plan: Plan, loss_fn: Callable[[Any, Any], Any]) -> None:
    """Load and check the evaluation data: pairs, enough batches, a first batch that collates and cuts,
    and (unless probe is false) whose first samples run through the model and the loss."""
    e = plan.spec.eval
    assert e is not None
    plan.eval_dataset, n = _dataset("eval.data", e.data.factory, e.data.args)
    plan.eval_collate = _collate("eval.data", e.data.collate)
    stream = plan.eval_stream()
    have = -(-n // e.data.batch_size)
    if stream.batches > have:
        raise SpecError(f"eval.batches: {stream.batches} batches of {e.data.batch_size} need more than the "
                        f"eval set's {n} items ({have} batches)")
    try:
        xs, ys, _ = stream.micro_batches(0)
    except Exception as ex:
        raise SpecError(f"eval.data: the first batch: {first_line(ex)}") from None
    _check_vocabulary("eval.data", e.data.factory, plan.eval_dataset, range(min(e.data.batch_size, n)),
                      plan.original or plan.model)
    if plan.spec.probe:
        if plan.on_meta:  # built on the meta device: the shapes alone, there
            from gpipe import structure

            xs[0], ys[0] = (structure.map_tensors(v, lambda t: t.to("meta")) for v in (xs[0], ys[0]))
        plan.probes.answer("eval", lambda: _passes(probe_eval, plan.model, xs[0], ys[0], loss_fn))


def _build_model(spec: JobSpec, meta: bool | None = None) -> tuple[Any, dict[str, torch.Tensor] | None]:
    """The model, and its buffers' values when it is built on the meta device (gpipe.capture.skeleton): with init
    per_layer, its layers checked for an init; with model.weights unless `meta` is false. Else the whole
    model, seeded (init exact), and None."""
    if meta is None:
        meta = spec.init == "per_layer" or (spec.model.weights is not None and spec.balance not in BY_RUNNING)
    if not meta:
        torch.manual_seed(spec.seed)
        return _call("model", spec.model.factory, spec.model.args), None
    if spec.init_hook is not None:
        try:
            resolve(spec.init_hook)
        except LookupError as e:
            raise SpecError(f"init_hook: {e}") from None
    model, buffers = skeleton.skeleton(lambda: _call("model", spec.model.factory, spec.model.args))
    if spec.init == "per_layer" and isinstance(model, nn.Sequential) and spec.init_hook is None:
        for i, layer in enumerate(model):
            if (what := uninitialisable(layer)) is not None:
                raise SpecError(f"init: layer {i}: {what} has parameters or buffers but no reset_parameters(); "
                                "give init_hook")
    return model, buffers


BY_RUNNING = ("by_time", "by_memory")  # balances that run the whole model: it is then built whole


def _footprint(spec: JobSpec, model: nn.Sequential, x: Any, y: Any,
               loss_fn: Callable[[Any, Any], Any]) -> tuple[footprint.Footprint | None, str]:
    """What each layer keeps for its backward, in the job's precision (gpipe.memory.footprint), on the first micro-batch;
    or None and why not. The probe ran the model already: a failure here stops only by_memory (SpecError), which
    needs it; the job runs on without a prediction."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(spec.precision)
    if any(t.is_meta for t in model.parameters()):  # built on the meta device: the shapes alone, there
        from gpipe import structure

        x, y = (structure.map_tensors(v, lambda t: t.to("meta")) for v in (x, y))

    def autocast() -> Any:  # (the CPU's: a model on the meta device counts its activations in float32)
        return torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()

    try:
        return footprint.measure(model, x, y, loss_fn, autocast), ""
    except Exception as e:
        why = f"measuring the layers' memory on the first micro-batch: {first_line(e)}"
        if spec.balance == "by_memory":
            raise SpecError(f"balance: by_memory could not run the model: {why}") from None
        return None, why


def _balance(spec: JobSpec, model: nn.Sequential, sample: Any, device: torch.device,
             threads: int, fp: footprint.Footprint | None, slots: int) -> tuple[list[int], list[float] | None]:
    """The balance, and the per-layer costs it was chosen by (none when given in the spec); `slots`: the
    optimizer's state tensors per parameter."""
    layers = len(model)
    if isinstance(spec.balance, list):
        if why := cuts.misfit(spec.balance, layers):
            raise SpecError(why)
        return list(spec.balance), None
    if spec.balance == "by_params":
        costs = balance.param_costs(model)
    else:
        try:
            if spec.balance == "by_time":
                costs = balance.time_costs(model, sample, device, threads)
            else:
                in_flight = max(schedule.simulate(spec.schedule, spec.stages, spec.chunks,
                                                  spec.virtual_stages).max_in_flight)
                assert fp is not None  # measured for by_memory
                costs = balance.memory_costs(model, fp, footprint.samples_of(sample), slots, in_flight)
        except Exception as e:
            raise SpecError(f"balance: {spec.balance} could not run the model on a sample micro-batch: "
                            f"{type(e).__name__}: {e}") from None
    return balance.partition(costs, spec.model_chunks), costs


def _shared_parameters(model: nn.Sequential, balance: list[int]) -> str | None:
    owner: dict[int, int] = {}
    for stage, (start, end) in enumerate(cuts.bounds(balance)):
        for i in range(start, end):
            for p in model[i].parameters():
                other = owner.setdefault(id(p), stage)
                if other != stage:
                    return f"a parameter of layer {i} (stage {stage}) is also used by stage {other}"
    return None


def step_waits(spec: JobSpec, tied: Sequence[Collection[int]]) -> list[set[int]]:
    """The sets of workers that end each step waiting for one another: every worker, for clipping's global
    norm and fp16's overflow check; each tied weight's holders (`tied`: the model chunks holding a copy of
    each), for its gradient's sum, unless they are one worker's chunks (summed in memory)."""
    if spec.clip_grad_norm or spec.precision == "fp16":
        return [set(range(spec.stages))]
    top = spec.topology  # replica 0's model chunks are slots 0..: their workers are ranks 0..stages-1
    holders = ({top.worker_of(g) for g in held} for held in tied)
    return [h for h in holders if len(h) > 1]
