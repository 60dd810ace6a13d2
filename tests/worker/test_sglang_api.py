"""The SGLang backend against the REAL pinned SGLang wheel: every SGLang name, parameter and field
the backend (services/worker/engines/sglang) uses must exist in that release's source.

SGLang cannot be imported here (it needs CUDA and its dependencies are not installed), so the test
opens the wheel `make sglang-wheel` downloads (.cache/sglang-wheel, a prerequisite of `make test`)
with zipfile and reads the modules by AST. The backend was once written against an API no released
version had (an audit found register_speculative_algorithm, an (obj) pause_generation and a
logprob_start_len that aborted every request on the pinned 0.5.4): fakes cannot catch that, this
test does. The wheel missing is a failure, not a skip. SEER_SGLANG_WHEEL points it at another wheel
(the old 0.5.4 fails it)."""

from __future__ import annotations

import ast
import os
import re
import warnings
import zipfile
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

from services.worker.config import WorkerConfig
from services.worker.engine import SamplingParams
from services.worker.engines.sglang import engine as sg
from services.worker.engines.sglang import plugin

ROOT = Path(__file__).resolve().parents[2]
ENGINE_DIR = ROOT / "services" / "worker" / "engines" / "sglang"


def pinned_version() -> str:
    """The pin, stated in the Makefile (the download) and the GPU image; both must agree."""
    make = re.search(r"^SGLANG_VERSION\s*:=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M)
    docker = re.search(r"^ARG SGLANG_VERSION=(\S+)", (ROOT / "docker" / "Dockerfile.gpu").read_text(), re.M)
    assert make and docker, "SGLANG_VERSION: not found in the Makefile or docker/Dockerfile.gpu"
    assert make.group(1) == docker.group(1), f"SGLANG_VERSION: Makefile {make.group(1)} != image {docker.group(1)}"
    return make.group(1)


def wheel_path() -> Path:
    env = os.environ.get("SEER_SGLANG_WHEEL")
    if env:
        return Path(env)
    version = pinned_version()
    found = sorted((ROOT / ".cache" / "sglang-wheel").glob(f"sglang-{version}-*.whl"))
    if not found:
        pytest.fail(f"the sglang {version} wheel is not in .cache/sglang-wheel: run `make sglang-wheel`")
    return found[-1]


class Wheel:
    def __init__(self, path: Path) -> None:
        self.zip = zipfile.ZipFile(path)
        self.names = set(self.zip.namelist())

    @cache  # noqa: B019 - one Wheel per session
    def source(self, module: str) -> str:
        base = module.replace(".", "/")
        for name in (f"{base}.py", f"{base}/__init__.py"):
            if name in self.names:
                return self.zip.read(name).decode("utf-8")
        raise AssertionError(f"{module}: no such module in the wheel")

    @cache  # noqa: B019
    def tree(self, module: str) -> ast.Module:
        with warnings.catch_warnings():  # SGLang's own invalid escape sequences
            warnings.simplefilter("ignore", SyntaxWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            return ast.parse(self.source(module))

    def cls(self, module: str, name: str) -> ast.ClassDef:
        for node in self.tree(module).body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return node
        raise AssertionError(f"{module}.{name}: no such class")

    def func(self, module: str, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
        for node in self.tree(module).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
                return node
        raise AssertionError(f"{module}.{name}: no such function")

    def method(self, module: str, cls: str, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
        for node in self.cls(module, cls).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
                return node
        raise AssertionError(f"{module}.{cls}.{name}: no such method")

    def fields(self, module: str, cls: str) -> set[str]:
        """Annotated class fields (dataclass / msgspec Struct) and __init__ parameters."""
        c = self.cls(module, cls)
        out = {n.target.id for n in c.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
        for n in c.body:
            if isinstance(n, ast.FunctionDef) and n.name == "__init__":
                out |= set(params(n)) - {"self"}
        return out

    def modules_under(self, package: str) -> Iterator[str]:
        prefix = package.replace(".", "/") + "/"
        for name in sorted(self.names):
            if name.startswith(prefix) and name.endswith(".py") and "/" not in name[len(prefix):]:
                yield name[:-3].replace("/", ".")


def params(f: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    a = f.args
    return [p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs]]


def calls_in(node: ast.AST, name: str) -> list[ast.Call]:
    """Calls of `name(...)` or `x.name(...)` inside node."""
    out = []
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            if (isinstance(f, ast.Name) and f.id == name) or (isinstance(f, ast.Attribute) and f.attr == name):
                out.append(n)
    return out


def our_tree(module: str) -> ast.Module:
    return ast.parse((ENGINE_DIR / f"{module}.py").read_text())


def our_keywords(module: str, callee: str) -> set[str]:
    """Keyword arguments the backend passes to callee(...) (ast, so every call site counts)."""
    found = calls_in(our_tree(module), callee)
    assert found, f"{callee}: the backend does not call it"
    return {k.arg for c in found for k in c.keywords if k.arg}


def seer_spec_methods() -> dict[str, ast.FunctionDef]:
    ours = next(n for n in ast.walk(our_tree("plugin")) if isinstance(n, ast.ClassDef) and n.name == "SeerSpecAlgo")
    return {n.name: n for n in ours.body if isinstance(n, ast.FunctionDef)}


def method_names(whl: Wheel, module: str, cls: str) -> set[str]:
    return {n.name for n in whl.cls(module, cls).body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def srt_modules(whl: Wheel) -> Iterator[str]:
    for name in sorted(whl.names):
        if name.startswith("sglang/srt/") and name.endswith(".py"):
            yield name[:-3].replace("/", ".")


@pytest.fixture(scope="module")
def whl() -> Wheel:
    return Wheel(wheel_path())


SRT = "sglang.srt"
SPEC = f"{SRT}.speculative.spec_info"
REGISTRY = f"{SRT}.speculative.spec_registry"
NGRAM = f"{SRT}.speculative.ngram_worker"
IO = f"{SRT}.managers.io_struct"
TM = f"{SRT}.managers.tokenizer_manager"
STORAGE = f"{SRT}.mem_cache.hicache_storage"


def test_the_plugin_entry_point_group_is_loaded_in_the_scheduler_process(whl: Wheel) -> None:
    """C1: a registration must reach the scheduler, a spawned subprocess: only SGLang's general
    plugin group (loaded by load_plugins in every process) does that."""
    group = re.search(r'^GENERAL_PLUGINS_GROUP = "([^"]+)"', whl.source(f"{SRT}.plugins"), re.M)
    assert group and group.group(1) == "sglang.srt.plugins"
    assert f'[project.entry-points."{group.group(1)}"]' in (ROOT / "pyproject.toml").read_text()
    assert 'seer = "services.worker.engines.sglang.plugin:register"' in (ROOT / "pyproject.toml").read_text()
    assert calls_in(whl.func(f"{SRT}.managers.scheduler", "run_scheduler_process"), "load_plugins")
    assert calls_in(whl.method(f"{SRT}.entrypoints.engine", "Engine", "__init__"), "load_plugins")


def test_the_speculative_algorithm_registry(whl: Wheel) -> None:
    """C1: SpeculativeAlgorithm.register(name, *, supports_overlap, validate_server_args, spec_class)
    returns a decorator for a factory(server_args) -> worker class; the spec class is a CustomSpecAlgo
    (re-exported by spec_info) whose methods the plugin's SeerSpecAlgo overrides."""
    reg = whl.method(SPEC, "SpeculativeAlgorithm", "register")
    assert [p.arg for p in reg.args.kwonlyargs] == ["supports_overlap", "validate_server_args", "spec_class"]
    assert params(whl.method(SPEC, "SpeculativeAlgorithm", "from_string"))[:2] == ["cls", "name"]
    imported = {a.name for n in whl.tree(SPEC).body if isinstance(n, ast.ImportFrom) for a in n.names}
    assert "CustomSpecAlgo" in imported  # plugin.py imports it from spec_info
    ours = seer_spec_methods()
    for name, m in ours.items():
        # Each override has the parameters of the method it stands in for (CustomSpecAlgo's, or
        # the built-in SpeculativeAlgorithm's where CustomSpecAlgo lacks it).
        base = (whl.method(REGISTRY, "CustomSpecAlgo", name) if name in method_names(whl, REGISTRY, "CustomSpecAlgo")
                else whl.method(SPEC, "SpeculativeAlgorithm", name))
        assert params(base) == params(m), name
    assert params(whl.method(REGISTRY, "CustomSpecAlgo", "create_worker")) == ["self", "server_args"]
    # create_worker calls the factory with the server args, and refuses overlap without support.
    create = ast.unparse(whl.method(REGISTRY, "CustomSpecAlgo", "create_worker"))
    assert "self.factory(server_args)" in create and "disable_overlap_schedule" in create
    # A registered algorithm's handle_server_args and validate_server_args are called.
    hook = whl.source(f"{SRT}.arg_groups.speculative_hook")
    assert "algo.handle_server_args" in hook and "algo.validate_server_args" in hook


def test_the_ngram_worker_the_plugin_subclasses(whl: Wheel) -> None:
    """C1/H1/H2: the methods SeerDraftWorker overrides exist with the same parameters; verification
    samples (eagle_sample) and computes per-token logprobs under speculation."""
    assert params(whl.method(NGRAM, "NGRAMWorker", "__init__")) == [
        "self", "server_args", "gpu_id", "nccl_port", "target_worker"]
    ours = next(n for n in ast.walk(our_tree("plugin")) if isinstance(n, ast.ClassDef) and n.name == "SeerDraftWorker")
    for m in (n for n in ours.body if isinstance(n, ast.FunctionDef) and n.name != "__init__"
              and not n.name.startswith("_seer")):
        # note_request_finished: BaseSpecWorker's hook (NGRAMWorker inherits its no-op), called at
        # a request's finish by the result processor.
        owner = (f"{SRT}.speculative.base_spec_worker", "BaseSpecWorker") if m.name == "note_request_finished" \
            else (NGRAM, "NGRAMWorker")
        assert params(whl.method(*owner, m.name)) == params(m), m.name
    processor = whl.tree(f"{SRT}.managers.scheduler_components.batch_result_processor")
    assert "draft_worker.note_request_finished(rid=" in ast.unparse(processor)
    init = ast.unparse(whl.method(NGRAM, "NGRAMWorker", "__init__"))
    assert "self.draft_token_num" in init
    fwd = whl.method(NGRAM, "NGRAMWorker", "forward_batch_generation")
    assert calls_in(fwd, "eagle_sample") and calls_in(fwd, "compute_spec_logprobs")
    assert calls_in(fwd, "_prepare_for_speculative_decoding") and calls_in(fwd, "_update_ngram_corpus")
    # The request fields the plugin reads.
    req = whl.cls(f"{SRT}.managers.schedule_batch", "Req")
    init_src = ast.unparse(next(n for n in req.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"))
    for attr in ("self.rid", "self.origin_input_ids", "self.output_ids", "self.sampling_params"):
        assert f"{attr} =" in init_src, attr
    whl.method(f"{SRT}.managers.schedule_batch", "Req", "finished")


def test_every_server_arg_the_worker_passes_is_a_server_args_field(whl: Wheel, tmp_path: Path) -> None:
    fields: set[str] = set()
    for module in whl.modules_under(f"{SRT}.arg_groups.fields"):
        for c in (n for n in whl.tree(module).body if isinstance(n, ast.ClassDef)):
            fields |= {n.target.id for n in c.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    cfg = WorkerConfig(engine="sglang", gamma_max=6, draft_width=2, page_size=16, kv_addresses=("kv:1",))
    kw = sg.server_kwargs(cfg, tmp_path, "m", str(tmp_path / "v"))
    assert set(kw) - fields == set()
    assert "enable_deterministic_inference" in fields  # what honours sampling_seed (README)


def test_generate_request_and_weights_calls(whl: Wheel) -> None:
    """C3/C4: the request and control objects the engine builds, and the TokenizerManager methods
    it awaits, with their parameters."""
    assert our_keywords("engine", "GenerateReqInput") <= whl.fields(IO, "GenerateReqInput")
    assert our_keywords("engine", "UpdateWeightFromDiskReqInput") <= whl.fields(IO, "UpdateWeightFromDiskReqInput")
    assert our_keywords("engine", "PauseGenerationReqInput") <= whl.fields(IO, "PauseGenerationReqInput")
    whl.cls(IO, "ContinueGenerationReqInput")
    mode = next(n for n in whl.cls(IO, "PauseGenerationReqInput").body
                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id == "mode")
    assert "'abort'" in ast.unparse(mode.annotation)
    expected = {"generate_request": ["self", "obj", "request"], "pause_generation": ["self", "obj"],
                "continue_generation": ["self", "obj"], "update_weights_from_disk": ["self", "obj", "request"]}
    for name, want in expected.items():
        m = whl.method(TM, "TokenizerManager", name)
        assert isinstance(m, ast.AsyncFunctionDef) and params(m) == want, name
    assert params(whl.method(TM, "TokenizerManager", "abort_request"))[:2] == ["self", "rid"]
    # Review 3: the update goes with flush_cache=False (SGLang's own flush, refused while the
    # scheduler still holds an aborted request, failed the call with the weights already in), then
    # TokenizerManager.flush_cache(timeout_s) (a mixin method) waits for an idle scheduler.
    assert "flush_cache" in our_keywords("engine", "UpdateWeightFromDiskReqInput")
    flush = whl.method(f"{SRT}.managers.tokenizer_control_mixin", "TokenizerControlMixin", "flush_cache")
    assert isinstance(flush, ast.AsyncFunctionDef) and params(flush) == ["self", "timeout_s"]
    assert "success" in whl.fields(IO, "FlushCacheReqOutput") and "timeout_s" in whl.fields(IO, "FlushCacheReqInput")
    assert 'TokenizerManager(TokenizerControlMixin' in whl.source(TM).replace("class ", "")
    updater = whl.source(f"{SRT}.managers.scheduler_components.weight_updater")
    assert f'"{sg._LOADED_NOT_FLUSHED} the cache was not flushed' in updater
    update = ast.unparse(whl.method(TM, "TokenizerManager", "update_weights_from_disk"))
    assert "return (success, message, num_paused_requests)" in update
    # Aborts match by rid prefix: attempt ids must be prefix-free (engine.attempt_rid).
    assert "req.rid.startswith(recv_req.rid)" in whl.source(f"{SRT}.managers.scheduler")
    # logprob_start_len -1 = output tokens only; one beyond the input aborts the request.
    handle = whl.source(f"{SRT}.managers.scheduler")
    assert "recv_req.logprob_start_len == -1" in handle
    assert "req.logprob_start_len = len(req.origin_input_ids)" in handle


def test_sampling_params_keys_and_seed_range(whl: Wheel) -> None:
    """H3: every key the worker sends is a SamplingParams field; the seed fits SGLang's int64."""
    keys = set(sg.sampling_dict(SamplingParams(seed=2**64 - 1), 8)) | {"custom_params"}
    assert keys <= whl.fields(f"{SRT}.sampling.sampling_params", "SamplingParams")
    src = whl.source(f"{SRT}.sampling.sampling_params")
    assert "-(2**63) <= self.sampling_seed <= 2**63 - 1" in src
    assert sg.SEED_MASK == 2**63 - 1
    info = whl.source(f"{SRT}.sampling.sampling_batch_info")
    assert re.search(r"sampling_seed\n.*?dtype=torch\.int64.*?if enable_deterministic", info, re.S)


def test_streamed_outputs_carry_what_stream_delta_reads(whl: Wheel) -> None:
    """H2/M3: output_ids in every streamed output, output_token_logprobs in meta_info, the spec
    counts in the final output's meta_info."""
    src = whl.source(TM)
    assert '"output_ids": state.output_ids' in src
    assert 'meta_info["output_token_logprobs"] = state.output_token_logprobs' in src
    for key in ("spec_num_correct_drafts", "spec_num_proposed_drafts", "completion_tokens", "cached_tokens"):
        assert f'"{key}"' in src, key
    assert '"max_total_num_tokens"' in whl.source(f"{SRT}.managers.scheduler")
    # served_context: the longest request SGLang serves whole, from the scheduler's init info.
    init_info = ast.unparse(whl.method(f"{SRT}.managers.scheduler", "Scheduler", "get_init_info"))
    assert "'max_req_input_len': self.max_req_input_len" in init_info
    assert "max_req_input_len = max_req_len - 5" in whl.source(f"{SRT}.managers.tp_worker")
    init = ast.unparse(whl.method(f"{SRT}.entrypoints.engine", "Engine", "__init__"))
    assert "self._scheduler_init_result =" in init


def test_the_engine_can_start_off_the_main_thread(whl: Wheel) -> None:
    """C2: sglang.Engine is built on the sglang-loop thread; SGLang must not install signal
    handlers there."""
    envs = ast.unparse(whl.func(f"{SRT}.entrypoints.engine", "_set_envs_and_config"))
    assert "threading.current_thread() is threading.main_thread()" in envs
    # ...so its SIGQUIT handler is not installed, and its children still SIGQUIT the parent on a
    # failure: the worker's __main__ installs its own (install_sglang_failure_handler).
    assert "signal.signal(signal.SIGQUIT" in envs
    assert "os.kill(os.getpid(), signal.SIGQUIT)" in whl.source(f"{SRT}.utils.watchdog")
    assert params(whl.method(f"{SRT}.entrypoints.engine", "Engine", "__init__")) == ["self"]  # **kwargs
    whl.method(f"{SRT}.entrypoints.engine", "Engine", "shutdown")
    lazy = r'^Engine = LazyImport\("sglang\.srt\.entrypoints\.engine", "Engine"\)'
    assert re.search(lazy, whl.source("sglang"), re.M)


def test_the_hicache_storage_interface(whl: Wheel) -> None:
    """M1: SeerHiCacheStorage's methods match HiCacheStorage's parameters; SGLang constructs a
    dynamic backend as cls(storage_config, kwargs) and uses the v1 calls with interface_v1."""
    ours = next(n for n in our_tree("storage").body if isinstance(n, ast.ClassDef) and n.name == "SeerHiCacheStorage")
    base = {n.name for n in whl.cls(STORAGE, "HiCacheStorage").body if isinstance(n, ast.FunctionDef)}
    overridden = [n for n in ours.body if isinstance(n, ast.FunctionDef) and n.name in base]
    assert {n.name for n in overridden} >= {"batch_exists", "batch_get_v1", "batch_set_v1", "get", "batch_get", "set",
                                            "batch_set", "exists"}
    for m in overridden:
        assert params(whl.method(STORAGE, "HiCacheStorage", m.name)) == params(m), m.name
    assert params(whl.method(STORAGE, "HiCacheStorage", "register_mem_pool_host")) == ["self", "mem_pool_host"]
    assert {"tp_rank", "tp_size", "extra_config"} <= whl.fields(STORAGE, "HiCacheStorageConfig")
    whl.cls(STORAGE, "HiCacheStorageExtraInfo")
    assert "return backend_class(storage_config, kwargs)" in whl.source(f"{SRT}.mem_cache.storage.backend_factory")
    controller = whl.source(f"{SRT}.managers.cache_controller")
    assert 'extra_config.get("interface_v1", 0)' in controller and "self.storage_backend.batch_get_v1(" in controller
    host = f"{SRT}.mem_cache.pool_host.base"
    assert params(whl.method(host, "HostKVCache", "get_data_page")) == ["self", "index", "flat"]
    assert params(whl.method(host, "HostKVCache", "set_from_flat_data_page")) == ["self", "index", "data_page"]
    whl.method(host, "HostKVCache", "get_dummy_flat_data_page")
    # M2: the request's extra_key reaches the Req and seeds the L3 page keys.
    assert "extra_key=recv_req.extra_key" in whl.source(f"{SRT}.managers.scheduler")
    assert "def storage_namespace_seed(" in whl.source(f"{SRT}.mem_cache.utils")


def test_the_tree_guard_matches_sglangs_ngram_guard(whl: Wheel) -> None:
    """C1: SGLang refuses topk > 1 with page_size > 1 off flashinfer for "NGRAM" only; the worker
    applies the same rule to SEER (plugin.tree_attention_backend)."""
    ngram = ast.unparse(whl.func(f"{SRT}.arg_groups.speculative_hook", "_handle_ngram"))
    assert "view.attention_backend != 'flashinfer'" in ngram and "enable_mixed_chunk=False" in ngram
    assert plugin.tree_attention_backend(2, 16, None) == "flashinfer"


# Methods of SpeculativeAlgorithm that SGLang calls only on the built-in enum, never on a registered
# algorithm: the classmethods, and the out-of-tree platform hook (called by the enum's own
# create_worker, spec_info.py:320, and by adaptive spec for EAGLE/EAGLE3 only,
# adaptive_spec_params.py:61-68).
_ENUM_ONLY = {"from_string", "register", "get_platform_worker_cls"}


def test_a_registered_seer_answers_every_call_sglang_makes_on_its_algorithm(whl: Wheel) -> None:
    """C1 (review): CustomSpecAlgo lacks three methods of SpeculativeAlgorithm that the scheduler
    calls on every start whatever the algorithm (carries_draft_hidden_states, scheduler.py:1540;
    create_future_map, :1681; need_topk, overlap_utils.py:381): SEER died at startup with
    AttributeError. Every public instance method of SpeculativeAlgorithm, and every method called
    anywhere in sglang.srt on an object named spec_algorithm / spec_algo, must resolve on
    CustomSpecAlgo or on the plugin's SeerSpecAlgo."""
    ours = set(seer_spec_methods())
    resolves = method_names(whl, REGISTRY, "CustomSpecAlgo") | ours
    enum = whl.cls(SPEC, "SpeculativeAlgorithm")
    public = {n.name for n in enum.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")
              and not any(isinstance(d, ast.Name) and d.id in ("classmethod", "staticmethod")
                          for d in n.decorator_list)}
    assert {"carries_draft_hidden_states", "create_future_map", "need_topk"} <= public
    assert sorted(public - _ENUM_ONLY - resolves) == []
    called: dict[str, str] = {}
    for module in srt_modules(whl):
        if "spec_algo" not in whl.source(module):
            continue  # parsing all of srt takes long; a call on such a name needs the text
        for n in ast.walk(whl.tree(module)):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
                obj = n.func.value
                name = obj.id if isinstance(obj, ast.Name) else obj.attr if isinstance(obj, ast.Attribute) else ""
                if name in ("spec_algorithm", "spec_algo"):
                    called.setdefault(n.func.attr, f"{module}:{n.lineno}")
    assert {"carries_draft_hidden_states", "create_future_map", "need_topk", "is_ngram"} <= set(called)
    missing = {m: where for m, where in called.items() if m not in resolves}
    assert missing == {}, f"called on the algorithm but not on SeerSpecAlgo/CustomSpecAlgo: {missing}"
    # SEER answers them as NGRAM does: the enum decides by is_eagle()/is_standalone(), False for NGRAM.
    for name in ("carries_draft_hidden_states", "need_topk"):
        body = ast.unparse(whl.method(SPEC, "SpeculativeAlgorithm", name))
        assert "is_ngram" not in body and "self.is_eagle()" in body, name
    fm = ast.unparse(whl.method(SPEC, "SpeculativeAlgorithm", "create_future_map"))
    assert "FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay)" in fm
    ours_fm = ast.unparse(seer_spec_methods()["create_future_map"])
    assert "FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay)" in ours_fm


BRP = f"{SRT}.managers.scheduler_components.batch_result_processor"


def test_the_step_order_the_draft_mirror_follows(whl: Wheel) -> None:
    """H (review): the plugin appended a step's tokens in _update_ngram_corpus, which runs inside
    forward_batch_generation, before result processing extends req.output_ids: appends lagged a
    step, a request's last tokens were never appended, and the planner paired step k-1's accepts
    with step k's drafts. SeerDraftWorker relies on this order instead (see its docstring):
    output_ids.extend only in process_batch_result_decode, after on_verify_complete_cpu (with this
    step's per-request counts, batch_size by keyword) and never inside the worker's forward."""
    fwd = whl.method(NGRAM, "NGRAMWorker", "forward_batch_generation")
    assert not calls_in(fwd, "extend") or all(
        not (isinstance(c.func, ast.Attribute) and ast.unparse(c.func.value).endswith("output_ids"))
        for c in calls_in(fwd, "extend"))
    # The corpus update precedes nothing that appends: it runs after eagle_sample, in forward.
    sample, update = calls_in(fwd, "eagle_sample")[0], calls_in(fwd, "_update_ngram_corpus")[0]
    assert sample.lineno < update.lineno
    decode = whl.method(BRP, "SchedulerBatchResultProcessor", "process_batch_result_decode")
    extends = [c for c in calls_in(decode, "extend") if ast.unparse(c.func) == "req.output_ids.extend"]
    assert extends, "req.output_ids.extend: not in process_batch_result_decode"
    normalize = [c for c in calls_in(decode, "_normalize_decode_outputs")]
    assert normalize and normalize[0].lineno < extends[0].lineno
    resolve = whl.method(BRP, "SchedulerBatchResultProcessor", "_resolve_spec_v2_tokens")
    (verify,) = calls_in(resolve, "on_verify_complete_cpu")
    assert ast.unparse(verify) == ("self.model_worker.on_verify_complete_cpu("
                                   "result.num_correct_drafts_per_req_cpu, batch_size=len(batch.reqs))")
    normalize_fn = whl.method(BRP, "SchedulerBatchResultProcessor", "_normalize_decode_outputs")
    assert calls_in(normalize_fn, "_resolve_spec_v2_tokens")
    assert params(whl.method(NGRAM, "NGRAMWorker", "on_verify_complete_cpu")) == [
        "self", "num_correct_drafts_per_req", "batch_size"]
    # NGRAM's accept_lens include the bonus token; the processor subtracts it (1 non-draft token).
    assert "num_correct_drafts_per_req_cpu = [length - num_non_draft for length in accept_lens]" in ast.unparse(
        resolve)
    # Drafts are prepared from complete output_ids only without overlap (which the plugin requires).
    prep = ast.unparse(whl.method(NGRAM, "NGRAMWorker", "_prepare_draft_tokens"))
    assert "use_prev_tokens = self.enable_overlap and (not batch.grammar_needs_sync())" in prep
    # A finished request's tokens through its stop (what the plugin appends last).
    stop = whl.method(f"{SRT}.managers.schedule_batch", "Req", "output_ids_through_stop")
    assert "self.output_ids[:self.finished_len]" in ast.unparse(stop)
    ours = next(n for n in ast.walk(our_tree("plugin")) if isinstance(n, ast.ClassDef) and n.name == "SeerDraftWorker")
    mine = {n.name: n for n in ours.body if isinstance(n, ast.FunctionDef)}
    assert not calls_in(mine["_update_ngram_corpus"], "verified")  # a no-op now
    assert calls_in(mine["forward_batch_generation"], "_seer_departures")


def test_the_host_pool_that_runs_has_what_the_storage_layout_reads(whl: Wheel) -> None:
    """M1 (review): SeerHiCacheStorage._layout() reads dtype, page_size, layer_num, head_num,
    head_dim and layout from the host pool; the pool SGLang builds for an MHA model is
    MHATokenToKVPoolHost (HostKVCache sets the first ones, the class the head fields)."""
    host = f"{SRT}.mem_cache.pool_host"
    mha = whl.cls(f"{host}.mha", "MHATokenToKVPoolHost")
    assert [ast.unparse(b) for b in mha.bases] == ["HostKVCache"]
    assigned: set[str] = set()
    for cls in (whl.cls(f"{host}.base", "HostKVCache"), mha):
        for n in ast.walk(cls):
            if isinstance(n, ast.Assign):
                assigned |= {t.attr for t in n.targets if isinstance(t, ast.Attribute)
                             and isinstance(t.value, ast.Name) and t.value.id == "self"}
    read = {n.attr for n in ast.walk(next(m for m in ast.walk(our_tree("storage"))
                                          if isinstance(m, ast.FunctionDef) and m.name == "_layout"))
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "pool"}
    assert read == {"dtype", "page_size", "layer_num", "head_num", "head_dim", "layout"}
    assert read <= assigned, read - assigned


def test_the_proposed_draft_count_sglang_reports_is_its_verify_block_capacity(whl: Wheel) -> None:
    """M-L (review): spec_num_proposed_drafts is verify steps x (num_draft_tokens - 1), padding
    included (SEER pads every block to N tokens), so the adapter does not report it: the plugin
    files each step's real draft count in Req.customized_info (plugin.record_step), which SGLang
    streams, sliced by output position, into meta_info under the same key."""
    calc = ast.unparse(whl.method(TM, "TokenizerManager", "_calculate_spec_decoding_metrics"))
    assert "num_proposed_drafts = recv_obj.spec_verify_ct[i] * (get_spec().speculative_num_draft_tokens - 1)" in calc
    assert "meta_info['spec_num_proposed_drafts'] = num_proposed_drafts" in calc
    assert not [n for n in ast.walk(our_tree("engine"))
                if isinstance(n, ast.Constant) and n.value == "spec_num_proposed_drafts"]
    # Req.customized_info: a dict of per-token lists, None until someone sets it.
    init = ast.unparse(whl.method(f"{SRT}.managers.schedule_batch", "Req", "__init__"))
    assert "self.customized_info: Optional[Dict[str, List[Any]]] = None" in init
    # The streamer sends each key's values for the positions not sent yet (token-level keys).
    streamer = f"{SRT}.managers.scheduler_components.output_streamer"
    src = whl.source(streamer)
    assert "for key, req_values in req.customized_info.items():" in src
    assert "values = req_values[send_token_offset : len(output_ids_)]" in src
    assert "def is_request_level_customized_info_key(self, key: str) -> bool:" in src
    # The tokenizer manager accumulates them into meta_info[key] on every output.
    acc = ast.unparse(whl.method(TM, "TokenizerManager", "_accumulate_request_meta_info"))
    assert "accumulated.extend(values)" in acc and "meta_info[key] = accumulated" in acc
    # on_verify_complete_cpu runs before the step's tokens are appended, and SGLang counts a verify
    # step only for a request neither retracted nor finished (what record_step mirrors).
    decode = ast.unparse(whl.method(BRP, "SchedulerBatchResultProcessor", "_resolve_spec_v2_tokens"))
    assert "if req.is_retracted or req.finished():" in decode and "req.spec_verify_ct += 1" in decode


def test_the_waiting_count_comes_from_the_load_snapshot(whl: Wheel) -> None:
    """stats().waiting: TokenizerManager.get_loads(include, dp_rank) (a mixin coroutine) is
    load_snapshot_reader.read_all() (include ignored), one LoadSnapshot per scheduler whose
    num_waiting_reqs counts the waiting queues; read_all takes a blocking file lock, so the backend
    calls the reader itself, in a thread (asyncio.to_thread), not get_loads on its loop."""
    mixin = f"{SRT}.managers.tokenizer_control_mixin"
    loads = whl.method(mixin, "TokenizerControlMixin", "get_loads")
    assert isinstance(loads, ast.AsyncFunctionDef) and params(loads) == ["self", "include", "dp_rank"]
    assert "List[LoadSnapshot]" in ast.unparse(loads.returns) if loads.returns else False
    body = ast.unparse(loads)
    assert "reader = self.load_snapshot_reader" in body and "results = reader.read_all()" in body
    assert "include" not in "\n".join(ast.unparse(st) for st in loads.body[1:])  # the docstring aside: never read
    snap = f"{SRT}.managers.load_snapshot"
    # Both readers' read_all (shared memory, and the zmq-fed one) take the flock or wrap the one that does.
    assert "fcntl.flock(fd, lock_type)" in whl.source(snap)
    assert not calls_in(our_tree("engine"), "get_loads")
    (_thread,) = [c for c in calls_in(our_tree("engine"), "to_thread")
                 if ast.unparse(c.args[0]).endswith("load_snapshot_reader.read_all")]
    assert "num_waiting_reqs" in whl.fields(snap, "LoadSnapshot")
    assert "num_waiting_reqs = sum((len(queue) for queue in waiting_queues))" in ast.unparse(
        whl.tree(f"{SRT}.managers.scheduler_components.load_inquirer"))
    # The reader is created with the tokenizer manager (no server flag needed).
    assert "self.load_snapshot_reader = create_load_snapshot_reader(" in whl.source(TM)
    # Published after every prefill and when idle, every load_snapshot_publish_interval-th decode
    # batch otherwise (15 by default): what the engine's comment says of the count's lag.
    publish = ast.unparse(whl.method(f"{SRT}.managers.scheduler", "Scheduler", "publish_load_snapshot"))
    assert "if writer.publish_counter < writer.publish_interval:" in publish
    assert "load_snapshot_publish_interval" in whl.source(f"{SRT}.arg_groups.fields.observability")


def test_the_accepted_tokens_the_plugin_walks_its_blocks_with(whl: Wheel) -> None:
    """Review (b1346aa): on_verify_complete_cpu gets only counts, which include a padding node
    matched by chance. SeerDraftWorker keeps the forward's GenerationBatchResult and walks each
    request's block over its committed tokens: next_token_ids = predict[accept_index] flattened,
    request i's accept_lens[i] tokens (accepted drafts, then the bonus) from i * stride, on the
    CPU by on_verify_complete_cpu. And the prefill's token is streamed before any verify step
    (the plugin opens the request's draft list at its extend batch)."""
    fwd = ast.unparse(whl.method(NGRAM, "NGRAMWorker", "forward_batch_generation"))
    assert "accept_tokens = predict[accept_index]" in fwd
    assert "accept_tokens = accept_tokens.flatten()" in fwd and "next_token_ids = accept_tokens" in fwd
    assert "next_token_ids=next_token_ids" in fwd
    assert "num_correct_drafts_per_req = accept_lens - 1" in fwd
    resolve = ast.unparse(whl.method(BRP, "SchedulerBatchResultProcessor", "_resolve_spec_v2_tokens"))
    assert "assert result.next_token_ids.is_cpu" in resolve
    assert "accept_tokens = next_token_ids[i * stride:i * stride + accept_lens[i]]" in resolve
    assert resolve.index("assert result.next_token_ids.is_cpu") < resolve.index("on_verify_complete_cpu")
    assert "stride = result.speculative_num_draft_tokens" in whl.source(BRP)
    assert "self.next_token_ids = _async_d2h(self.next_token_ids)" in whl.source(f"{SRT}.managers.utils")
    # A padding node's token is a real token: the model may sample it (no vocabulary reserves 0).
    from services.worker.engines.sglang import drafts
    assert drafts.PAD_TOKEN == 0
    ours = next(n for n in ast.walk(our_tree("plugin")) if isinstance(n, ast.ClassDef) and n.name == "SeerDraftWorker")
    mine = {n.name: n for n in ours.body if isinstance(n, ast.FunctionDef)}
    assert calls_in(mine["on_verify_complete_cpu"], "accepted_drafts")
    assert calls_in(mine["forward_batch_generation"], "open_step_info")
