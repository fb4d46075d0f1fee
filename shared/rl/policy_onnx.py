"""The samplers' policy through onnxruntime, and the rule that picks the samplers' inference backend.

``sampler.inference`` chooses how a sampler runs the network: ``numpy`` (:class:`~shared.rl.policy_np.NumpyPolicy`,
MLPs only), ``torch`` (:class:`~shared.rl.policy_torch.TorchPolicy`) or ``onnx`` (:class:`OnnxPolicy`);
``auto`` (:func:`resolve_inference`) takes what measured fastest for one action batch at the configs' sizes
(``bench/figures/sampler_inference.py``; docs/pixels.md, "Sampler inference", has the table): numpy for the
MLP, onnxruntime for the CNNs. At a sampler's batch (4 to 16 envs) a torch forward pass is mostly per-operator
dispatch overhead, which onnxruntime's static graph does not pay. Measured on the 2-core development machine
(1 thread, microseconds per action batch, median of 9 rounds):

================================  =====  =====  ===========
config (batch)                    numpy  torch  onnxruntime
================================  =====  =====  ===========
cartpole (8 x 4)                  33     70     26
minatar-breakout (16 x 10x10x4)   -      690    222
pong (4 x 4x84x84)                -      4064   1945
================================  =====  =====  ===========

onnxruntime is 3.1x (MinAtar) and 2.1x (Pong) faster than torch for the CNNs. For the MLP numpy and onnxruntime
tie within the rounds' spread (25-44 against 23-42; a shorter run had numpy ahead, 54 against 67), and numpy keeps
torch and onnxruntime out of the sampler process (importing them took 5.4 s and 690 MB resident here, numpy
0.3 s and 26 MB), so ``auto`` keeps numpy.

How :class:`OnnxPolicy` keeps up with new policy versions without exporting each one (an export takes seconds):
the graph (the actor's log-softmax of the trainer's model, :class:`~shared.rl.model.ActorCritic` or the CNN) is
exported once at construction, unoptimised so that every weight stays an initializer named after its state_dict
key; :meth:`OnnxPolicy.load` checks a blob with the loader every side uses
(:func:`~shared.rl.policy_np.validate_weights`), writes its tensors into those initializers and opens a new
session (tens of milliseconds; onnxruntime optimises the graph then). Actions are sampled in numpy with the
sampler's generator by the rule the torch policy uses (:func:`~shared.rl.policy_torch.sample_discrete`), so for
the same weights, observations and generator the two backends give the same actions.

Torch, onnx and onnxruntime are imported by :class:`OnnxPolicy` only: :func:`resolve_inference` is cheap to import.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Literal

import numpy as np

from shared.fragment import FragmentSpec
from shared.rl.policy_np import validate_weights

if TYPE_CHECKING:
    import onnx
    import onnxruntime
    import torch

    from shared.rl.model import ActorCritic

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


class OnnxPolicy:
    """``act(obs, rng)`` for observations shaped as :func:`example_batch` (any number of rows) through
    onnxruntime; discrete actions only (as :class:`~shared.rl.policy_torch.TorchPolicy`).

    Invariant: the session always holds the last blob :meth:`load` accepted (a refused blob changes nothing)."""

    def __init__(self, model: ActorCritic, example: np.ndarray, threads: int = 1) -> None:
        import torch
        from torch import nn

        from shared.rl.policy_torch import sample_discrete

        if model.continuous:
            raise ValueError("OnnxPolicy samples discrete actions only")
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.gsde = False  # discrete actions only: no exploration state (as NumpyPolicy.gsde)
        self.threads = threads
        self.shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        self._dtype = example.dtype
        self._sample = sample_discrete

        # The exporter shares one initializer between equal tensors (two zero-initialised biases of one shape
        # would become one), and load() must be able to write each weight on its own: export a copy whose every
        # float tensor holds distinct random values (the real weights arrive with the first version anyway).
        stand_in = copy.deepcopy(model)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for t in stand_in.state_dict().values():
                if t.is_floating_point():
                    t.copy_(torch.randn(t.shape, generator=gen))

        class LogProbs(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = stand_in

            def forward(self, obs: torch.Tensor) -> torch.Tensor:
                return self.model.log_probs(obs)

        proto = export_graph(LogProbs().eval(), example)
        keys = {_PREFIX + k: k for k in self.shapes}
        self._initializers = {init.name: keys[init.name] for init in proto.graph.initializer if init.name in keys}
        # Every weight the actor reads must be an initializer we can overwrite, or a new version would act with
        # the export's weights: refuse here, at start-up, instead.
        actor = {id(p) for p in model.actor_parameters()}
        needed = {k for k, p in model.named_parameters() if id(p) in actor}
        needed |= {k for k in self.shapes if k.startswith("obs_norm.")}
        missing = needed - set(self._initializers.values())
        if missing:
            raise RuntimeError(f"the exported graph does not name these weights as initializers: {sorted(missing)}")
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
        ``trainer.activation``)."""
        from shared.rl.model import ActorCritic

        return cls(ActorCritic.for_spec(spec, hidden, model=model, activation=activation), example_batch(spec),
                   threads)

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
        return self._sample(self.log_probs(obs), rng)
