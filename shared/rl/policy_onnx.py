"""The samplers' policy through onnxruntime, and the rule that picks the samplers' inference backend.

``sampler.inference`` chooses how a sampler runs the network: ``numpy`` (:class:`~shared.rl.policy_np.NumpyPolicy`,
MLPs only), ``torch`` (:class:`~shared.rl.policy_torch.TorchPolicy`) or ``onnx`` (:class:`OnnxPolicy`);
``auto`` (:func:`resolve_inference`) takes what measured fastest for one action batch at the configs' sizes
(``bench/figures/sampler_inference.py``; docs/pixels.md, "Sampler inference", has the table): numpy for the
MLP, onnxruntime for the CNNs. At a sampler's batch (4 to 16 envs) a torch forward pass is mostly per-operator
dispatch overhead, which onnxruntime's static graph does not pay: the ``sampler_inference`` figure
(docs/benchmarks.md) measures each backend at each config's batch. For the MLP numpy and onnxruntime are within a
few microseconds of each other, and numpy keeps torch and onnxruntime out of the sampler process, so ``auto`` keeps
numpy.

How :class:`OnnxPolicy` keeps up with new policy versions without building a graph for each one: the graph (the
actor's log-softmax of the trainer's model, :class:`~shared.rl.model.ActorCritic` or the CNN) is built once at
construction by :func:`policy_graph`, from the architecture's tables (:mod:`shared.rl.layout`) with ONNX's own
helpers and without torch, every weight an initializer named after its state_dict key (the torch exporter,
:func:`export_graph`, serves ``flywheel export`` and the tests, which check that both graphs give the same
log-probabilities); :meth:`OnnxPolicy.load` checks a blob with the loader every side uses
(:func:`~shared.rl.policy_np.validate_weights`), writes its tensors into those initializers and opens a new
session (tens of milliseconds; onnxruntime optimises the graph then). Actions are sampled in numpy with the
sampler's generator by the rule the torch policy uses (:func:`~shared.rl.policy_torch.sample_discrete`), so for
the same weights, observations and generator the two backends give the same actions.

onnx and onnxruntime are imported by :class:`OnnxPolicy` only (:func:`resolve_inference` is cheap to import), and
torch never on the samplers' path: a sampler with ``sampler.inference`` auto, numpy or onnx runs without torch
installed (the ``train`` extra; the torch-free sampler image, deploy/Dockerfile's ``sampler`` target).
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Literal

import numpy as np

from shared.fragment import FragmentSpec
from shared.rl.layout import CONVS, image_layout, image_shapes, resolve_model
from shared.rl.policy_np import check_activation, expected_shapes, validate_weights

if TYPE_CHECKING:
    import onnx
    import onnxruntime
    import torch

Backend = Literal["numpy", "torch", "onnx"]
OPSET = 18
"""ONNX opset of the samplers' graph (onnxruntime >= 1.14 runs it)."""
_PREFIX = "model."  # the exported wrapper's attribute: initializer "model.<state_dict key>"


def runs_cnn(model: str, spec: FragmentSpec) -> bool:
    """Whether ``trainer.model`` on ``spec``'s env is a CNN (``auto``: for uint8 image frames), which the numpy
    policy cannot run."""
    return model != "mlp" and (model != "auto" or spec.obs_dtype == "uint8")


def resolve_inference(inference: str, image_model: bool) -> Backend:
    """The backend ``sampler.inference`` asks for: ``auto`` is onnxruntime for a CNN (``image_model``) and numpy
    for the MLP (the figures in the module docstring); ``numpy`` for a CNN is refused (it has no convolutions)."""
    if inference == "auto":
        return "onnx" if image_model else "numpy"
    if inference == "numpy" and image_model:
        raise ValueError("sampler.inference='numpy' runs the MLP only; a CNN model needs torch, onnx or auto")
    if inference not in ("numpy", "torch", "onnx"):
        raise ValueError(f"sampler.inference={inference!r}: want auto, numpy, torch or onnx")
    return inference  # type: ignore[return-value]


@contextlib.contextmanager
def quiet_exporter() -> Iterator[None]:
    """The ONNX exporter prints its progress on stdout and warns about torchvision on its logger: keep both out
    of a service's output (errors still raise)."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)


def export_graph(module: torch.nn.Module, example: np.ndarray, legacy: bool = True) -> onnx.ModelProto:
    """``module`` (obs -> logp) as an ONNX graph with a dynamic batch axis. TorchScript's exporter by default:
    0.1-0.3 s for the Nature CNN where torch.export + onnxscript (``legacy=False``) took 5.5 s of every
    sampler's start-up (docs/pixels.md). PyTorch deprecates it, so where it is gone or fails the new exporter
    serves. No constant folding either way: every weight stays an initializer named by its parameter."""
    import onnx
    import torch

    if legacy:
        buf = io.BytesIO()
        try:
            with quiet_exporter(), torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # its deprecation notice, once per sampler
                torch.onnx.export(module, (torch.from_numpy(example),), buf,  # type: ignore[arg-type]
                                  dynamo=False, input_names=["obs"], output_names=["logp"], opset_version=OPSET,
                                  do_constant_folding=False, dynamic_axes={"obs": {0: "batch"}, "logp": {0: "batch"}})
            return onnx.load_from_string(buf.getvalue())
        except Exception as exc:  # removed or broken in this torch: the new exporter below
            logging.getLogger(__name__).warning("TorchScript ONNX export failed (%s); using torch.export", exc)
    with quiet_exporter(), torch.no_grad():
        program = torch.onnx.export(
            module, (torch.from_numpy(example),), dynamo=True, input_names=["obs"], output_names=["logp"],
            opset_version=OPSET, optimize=False, verbose=False, external_data=False,
            dynamic_shapes=({0: torch.export.Dim("batch", min=1)},))
    assert program is not None
    proto: onnx.ModelProto = program.model_proto
    return proto


def example_batch(spec: FragmentSpec, rows: int = 2) -> np.ndarray:
    """Zeros shaped as a sampler's policy input for ``spec``: frame stacks ``[rows, K, *O]`` uint8 for image
    envs (``FrameStacker.stacks``), else ``[rows, obs_dim]`` float32."""
    if spec.obs_dtype == "uint8":
        return np.zeros((rows, spec.frame_stack, *spec.obs_shape), np.uint8)
    return np.zeros((rows, int(np.prod(spec.obs_shape))), np.float32)


def policy_graph(spec: FragmentSpec, model: str, hidden: int, activation: str = "tanh"
                 ) -> tuple[onnx.ModelProto, dict[str, tuple[int, ...]], set[str]]:
    """The samplers' graph for ``spec``'s env (``model``, ``hidden``, ``activation``: the trainer's settings), built
    with ONNX's helpers and no torch: input ``obs`` shaped as :func:`example_batch` with a dynamic batch axis,
    output ``logp`` ``[batch, A]``, the actor's log-softmax as :meth:`shared.rl.model.ActorCritic.log_probs`
    computes it. Returns the graph (weights: zero initializers named ``model.<state_dict key>``), the whole state
    dict's shapes (what a blob must hold, critic included) and the keys the graph reads. Discrete actions only; the
    MLP without observation normalisation (as ``sampler_policy`` allows for onnx)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    if spec.continuous:
        raise ValueError("OnnxPolicy samples discrete actions only")
    kind = resolve_model(spec, model)
    nodes: list[onnx.NodeProto] = []
    consts: list[onnx.TensorProto] = []

    def const(name: str, value: np.ndarray) -> str:
        consts.append(numpy_helper.from_array(value, name))
        return name

    def linear(x: str, key: str, out: str) -> str:  # torch's Linear: x @ W.T + b
        nodes.append(helper.make_node("Gemm", [x, _PREFIX + key + ".weight", _PREFIX + key + ".bias"], [out],
                                      transB=1))
        return out

    example = example_batch(spec)
    if kind == "mlp":
        check_activation(activation)
        shapes = expected_shapes(int(np.prod(spec.obs_shape)), spec.num_actions, hidden)
        act = "Relu" if activation == "relu" else "Tanh"
        x = "obs"
        for i, layer in enumerate(("actor.0", "actor.2")):
            nodes.append(helper.make_node(act, [linear(x, layer, f"h{i}_pre")], [f"h{i}"]))
            x = f"h{i}"
        logits = linear(x, "actor.4", "logits")
        reads = {k for k in shapes if k.startswith("actor.")}
    else:
        shapes = image_shapes(spec, kind)
        c, h, w, channels_last = image_layout(spec.obs_shape)
        k = spec.frame_stack
        # ImageActorCritic._features: frames as float / 255, stacked frames' channels side by side [B, K * C, H, W]
        nodes.append(helper.make_node("Cast", ["obs"], ["obs_f"], to=TensorProto.FLOAT))
        nodes.append(helper.make_node("Div", ["obs_f", const("c255", np.array(255.0, np.float32))], ["scaled"]))
        x = "scaled"
        if len(spec.obs_shape) == 3 and channels_last:  # [B, K, H, W, C] -> [B, K, C, H, W]
            nodes.append(helper.make_node("Transpose", [x], ["chw"], perm=[0, 1, 4, 2, 3]))
            x = "chw"
        nodes.append(helper.make_node("Reshape", [x, const("nchw", np.array([-1, k * c, h, w], np.int64))],
                                      ["conv_in"]))
        x = "conv_in"
        for i, (_, size, stride) in enumerate(CONVS[kind]):
            key = f"torso.{2 * i}"
            nodes.append(helper.make_node("Conv", [x, _PREFIX + key + ".weight", _PREFIX + key + ".bias"],
                                          [f"conv{i}"], kernel_shape=[size, size], strides=[stride, stride]))
            nodes.append(helper.make_node("Relu", [f"conv{i}"], [f"relu{i}"]))
            x = f"relu{i}"
        nodes.append(helper.make_node("Flatten", [x], ["flat"], axis=1))
        nodes.append(helper.make_node("Relu", [linear("flat", f"torso.{2 * len(CONVS[kind]) + 1}", "fc")],
                                      ["features"]))
        logits = linear("features", "actor", "logits")
        reads = {k for k in shapes if not k.startswith("critic.")}
    nodes.append(helper.make_node("LogSoftmax", [logits], ["logp"], axis=-1))
    weights = [numpy_helper.from_array(np.zeros(shapes[key], np.float32), _PREFIX + key) for key in sorted(reads)]
    dtype = TensorProto.UINT8 if example.dtype == np.uint8 else TensorProto.FLOAT
    graph = helper.make_graph(
        nodes, "flywheel_policy",
        [helper.make_tensor_value_info("obs", dtype, ["batch", *example.shape[1:]])],
        [helper.make_tensor_value_info("logp", TensorProto.FLOAT, ["batch", spec.num_actions])],
        initializer=weights + consts)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="flywheel")
    proto.ir_version = 8  # onnxruntime >= 1.14 reads it (opset 18)
    onnx.checker.check_model(proto)
    return proto, shapes, reads


class OnnxPolicy:
    """``act(obs, rng)`` for observations shaped as :func:`example_batch` (any number of rows) through
    onnxruntime; discrete actions only (as :class:`~shared.rl.policy_torch.TorchPolicy`). Needs no torch.

    Invariant: the session always holds the last blob :meth:`load` accepted (a refused blob changes nothing)."""

    def __init__(self, proto: onnx.ModelProto, shapes: dict[str, tuple[int, ...]], example: np.ndarray,
                 threads: int = 1) -> None:
        """``proto``: a graph from :func:`policy_graph` (or :func:`export_graph`) whose weights are initializers
        named ``model.<key>``; ``shapes``: the blob's keys and shapes."""
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.gsde = False  # discrete actions only: no exploration state (as NumpyPolicy.gsde)
        self.threads = threads
        self.shapes = dict(shapes)
        self._dtype = example.dtype
        keys = {_PREFIX + k: k for k in self.shapes}
        self._initializers = {init.name: keys[init.name] for init in proto.graph.initializer if init.name in keys}
        # Serialised once. load() parses a fresh proto from these bytes for each version, writes the weights into
        # it, and drops it: writing them into one long-lived proto (CopyFrom on its initializers) kept about one
        # blob of memory per adopted version, without bound (protobuf's arena is freed only with the message): 20
        # adoptions of a 46.5 MB policy grew a sampler from 905 to 1,708 MiB (docs/scaling.md, policy fan-out).
        self._model_bytes = proto.SerializeToString()
        self._session: onnxruntime.InferenceSession | None = None

    @classmethod
    def for_spec(cls, spec: FragmentSpec, model: str, hidden: int, threads: int = 1, *,
                 activation: str = "tanh") -> OnnxPolicy:
        """The policy a sampler of ``spec``'s env uses (``model``, ``activation``: ``trainer.model`` and
        ``trainer.activation``), its graph from :func:`policy_graph` (no torch)."""
        proto, shapes, reads = policy_graph(spec, model, hidden, activation)
        policy = cls(proto, shapes, example_batch(spec), threads)
        # Every weight the actor reads must be an initializer load() overwrites, or a new version would act with
        # the graph's zeros: refuse here, at start-up, instead.
        missing = reads - set(policy._initializers.values())
        if missing:
            raise RuntimeError(f"the graph does not name these weights as initializers: {sorted(missing)}")
        return policy

    @property
    def loaded(self) -> bool:
        return self._session is not None

    def load(self, data: bytes) -> None:
        """Adopt a safetensors blob; raises ``WeightsError`` (keeping the current session) if it does not fit."""
        import onnx
        import onnxruntime as ort
        from onnx import numpy_helper

        tensors = validate_weights(data, self.shapes)
        proto = onnx.ModelProto.FromString(self._model_bytes)
        for init in proto.graph.initializer:
            key = self._initializers.get(init.name)
            if key is not None:
                init.CopyFrom(numpy_helper.from_array(tensors[key], init.name))
        model_bytes = proto.SerializeToString()
        del proto
        options = ort.SessionOptions()
        options.intra_op_num_threads = self.threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        # The sampler's thread steps the envs between two inferences: idle pool threads must not spin on its cores.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self._session = ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])

    def log_probs(self, obs: np.ndarray) -> np.ndarray:
        """Log-probabilities of every action ``[N, A]`` (float32)."""
        if self._session is None:
            raise RuntimeError("no weights loaded yet")
        out: np.ndarray = self._session.run(["logp"], {"obs": np.ascontiguousarray(obs, self._dtype)})[0]
        return out

    def act(self, obs: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """One action per row (int64 ``[N]``) and its log-prob (float32 ``[N]``)."""
        return sample_discrete(self.log_probs(obs), rng)


def sample_discrete(log_probs: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One action per row of ``log_probs`` ``[N, A]`` by the inverse-CDF rule of
    :class:`~shared.rl.policy_np.NumpyPolicy` (one uniform per row from ``rng``), and its log-prob: int64 ``[N]``
    and float32 ``[N]``. The rule every torch-model backend samples with (torch, onnxruntime), so the same
    log-probs and generator give the same actions whichever ran the network. Here, without torch, for the
    onnxruntime sampler; :mod:`shared.rl.policy_torch` re-exports it."""
    lp = np.asarray(log_probs, np.float64)
    if not np.isfinite(lp).all():
        raise ValueError("policy logits are not finite")
    cdf = np.exp(lp).cumsum(axis=1)
    u = rng.random(lp.shape[0]) * cdf[:, -1]
    actions = (cdf[:, :-1] <= u[:, None]).sum(axis=1, dtype=np.int64)
    return actions, lp[np.arange(lp.shape[0]), actions].astype(np.float32)
