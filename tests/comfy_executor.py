"""ComfyUI's executor semantics without ComfyUI, so CI runs the nodes the way a real server does.

What it reproduces, read from ComfyUI 0.3.64 (Comfy-Org/ComfyUI a125cd84):

* ``execution.py`` ``PromptExecutor.execute``: every prompt runs inside ``torch.inference_mode()``, so the tensors a
  loader node creates are inference tensors (no version counter, no in-place use outside inference mode).
* ``comfy/model_management.py`` ``throw_exception_if_processing_interrupted``: the interrupt flag is one-shot; the
  check that sees it clears it as it raises ``InterruptProcessingException``. Whoever sees it first must stop the run.
* The output cache: a node runs again only when its inputs (widget values, or the nodes it is linked to) changed;
  otherwise its previous outputs are reused (what the server reports as ``execution_cached``).
* Lazy inputs: ``check_lazy_status`` is asked which lazy inputs the node needs; the others are never evaluated.
* Queue-time validation: widget values against the schema, and the node's ``validate_inputs``.
* Models through a ModelPatcher-like lifecycle: ``load_models_gpu`` loads each patcher; between queues the executor can
  unload them (ComfyUI's "free memory", or memory pressure), which moves the weights to the offload device and back
  on the next load: new storage, same values (what a GPU round trip does to ``data_ptr()``).

The SDVG nodes run through ``nodes.logic.run_node`` / ``needed_inputs`` / ``geometry_problem``, exactly the calls the
V3 classes in ``nodes/comfy_nodes.py`` make (``test_executor.py`` checks that). Core nodes are small stand-ins that
produce what ComfyUI's produce (a Wan VAE object, CONDITIONING, IMAGE/MASK tensors) with tiny real models.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from nodes import logic, schema
from node_fixtures import FakeComfyVAE, StandInCLIP
from workflow_checks import check_api_workflow


class InterruptProcessingException(Exception):
    """ComfyUI's ``comfy.model_management.InterruptProcessingException``."""


class OneShotInterrupt:
    """ComfyUI's ``interrupt_processing`` flag: ``set()`` is the Cancel button; the first check clears it as it raises."""

    def __init__(self):
        self._flag = False
        self._lock = threading.Lock()
        self.raised_on: list[str] = []  # thread names of the checks that raised

    def set(self) -> None:
        with self._lock:
            self._flag = True

    @property
    def is_set(self) -> bool:
        return self._flag

    def throw_if_interrupted(self) -> None:
        with self._lock:
            if self._flag:
                self._flag = False
                self.raised_on.append(threading.current_thread().name)
                raise InterruptProcessingException()


class Patcher:
    """ModelPatcher-like handle: ``load()`` puts the module on its load device, ``unload()`` on its offload device,
    re-materialising every tensor as a device round trip would (same values, new storage)."""

    def __init__(self, holder: torch.nn.Module, load_device, offload_device):
        self.model, self.load_device, self.offload_device = holder, torch.device(load_device), torch.device(offload_device)
        self.loaded = False
        self.loads = 0
        self.unloads = 0

    def load(self) -> None:
        if not self.loaded:
            self.model.to(self.load_device)
            self.model.device = self.load_device
            self.loaded, self.loads = True, self.loads + 1

    def unload(self) -> None:
        if self.loaded:
            # Under inference mode, as ComfyUI's model management runs inside a prompt: moving inference tensors
            # outside it leaves parameters that no forward can use (a torch property, not an SDVG one).
            with torch.inference_mode():
                self.model._apply(lambda t: t.to(self.offload_device).clone())
            self.model.device = self.offload_device
            self.loaded, self.unloads = False, self.unloads + 1


class ExecutorServices(logic.Services):
    """What ``ComfyServices`` provides, with the executor's interrupt flag, patchers, progress and activity."""

    def __init__(self, executor: "Executor", node_id: str | None = None):
        super().__init__(executor.folders)
        self.executor, self.node_id = executor, node_id

    def wrap(self, holder, load_device, offload_device):
        patcher = Patcher(holder, load_device, offload_device)
        self.executor.patchers.append(patcher)
        return patcher

    def load(self, patchers):
        for p in patchers:
            p.load()

    def check_interrupt(self):
        if self.executor.before_check is not None:  # a test's scheduling gate (which thread checks first)
            self.executor.before_check()
        self.executor.interrupt.throw_if_interrupted()

    def progress(self, value, total, preview=None):
        self.executor.progress.append((self.node_id, value, total))
        if self.executor.on_progress is not None:
            self.executor.on_progress(value, total)

    def activity(self, text):
        self.executor.activity.append((self.node_id, text))


@dataclass
class QueueResult:
    status: str  # "success", "interrupted" or "error"
    outputs: dict[str, tuple] = field(default_factory=dict)  # node id -> its outputs (executed or cached)
    executed: list[str] = field(default_factory=list)
    cached: list[str] = field(default_factory=list)
    error: BaseException | None = None
    ui: dict[str, str] = field(default_factory=dict)  # node id -> UI text


# --------------------------------------------------------------------------------------------------- core nodes
def _mask_to_image(mask: torch.Tensor) -> tuple:
    # nodes_mask.py MaskToImage: reshape to [B, 1, H, W], move the channel last, expand to 3.
    return (mask.reshape((-1, 1, mask.shape[-2], mask.shape[-1])).movedim(1, -1).expand(-1, -1, -1, 3),)


def _check_image(images: torch.Tensor) -> None:
    assert images.ndim == 4 and images.shape[-1] == 3 and images.dtype == torch.float32, images.shape
    assert float(images.min()) >= 0.0 and float(images.max()) <= 1.0


def core_nodes(vae_factory: Callable[[str], Any], encode_text: Callable[[str], torch.Tensor]) -> dict[str, Callable]:
    """Stand-ins of the core nodes the shipped workflows use: inputs by name -> outputs tuple."""
    def save(images=None, **_):
        _check_image(images)
        return ()

    return {
        "VAELoader": lambda vae_name: (vae_factory(vae_name),),
        # a CLIP object with the two calls CLIPTextEncode makes (SDVG Prompt Schedule makes them too)
        "CLIPLoader": lambda clip_name, type, device="default": (StandInCLIP(encode_text),),
        "CLIPTextEncode": lambda text, clip: (clip.encode_from_tokens_scheduled(clip.tokenize(text)),),
        "PrimitiveStringMultiline": lambda value: (value,),
        "CreateVideo": lambda images, fps, audio=None: (_check_image(images) or {"images": images, "fps": fps},),
        "SaveVideo": lambda video, filename_prefix, format="auto", codec="auto": save(video["images"]),
        "MaskToImage": lambda mask: _mask_to_image(mask),
        "SaveAnimatedWEBP": lambda images, **kw: save(images),
        "SaveImage": lambda images, filename_prefix="ComfyUI": save(images),
        "PreviewAny": lambda source: (),
    }


class Executor:
    """Runs API-format prompts (what ``POST /prompt`` takes) with ComfyUI's semantics; see the module docstring."""

    def __init__(self, folders: dict, *, vae_factory: Callable[[str], Any] | None = None,
                 encode_text: Callable[[str], torch.Tensor] | None = None):
        self.folders = folders
        self.interrupt = OneShotInterrupt()
        self.patchers: list[Patcher] = []
        self.progress: list[tuple] = []
        self.activity: list[tuple] = []
        self.on_progress: Callable[[int, int], None] | None = None
        #: called before every interrupt check of a node: lets a test choose which worker thread sees a Cancel first
        #: (a real click lands wherever the threads happen to be; this makes one such interleaving repeatable)
        self.before_check: Callable[[], None] | None = None
        self._cache: dict[str, tuple[tuple, tuple]] = {}  # node id -> (input signature, outputs)
        vaes: dict[str, Any] = {}
        self._core = core_nodes(vae_factory or (lambda name: vaes.setdefault(name, FakeComfyVAE())),
                                encode_text or _no_text_encoder)

    # --- model lifecycle
    def unload_models(self) -> None:
        """ComfyUI's "free memory" / memory pressure between queues."""
        for p in self.patchers:
            p.unload()

    def free_memory(self) -> None:
        """Unload every model and drop every cached output (the loaders run again on the next queue)."""
        self.unload_models()
        self._cache.clear()

    # --- running
    def queue(self, prompt: dict) -> QueueResult:
        problems = check_api_workflow(prompt)
        for nid, node in prompt.items():
            if node["class_type"] == "SDVGSpeculativeSampler":
                length = node["inputs"].get("length")
                if not isinstance(length, list) and (p := logic.geometry_problem(None, None, length)):
                    problems.append(f"node {nid}: {p}")
        if problems:
            raise ValueError("prompt rejected at queue time: " + "; ".join(problems))
        result = QueueResult(status="success")
        signatures: dict[str, tuple] = {}
        with torch.inference_mode():
            try:
                for nid in self._output_nodes(prompt):
                    self._evaluate(prompt, nid, result, signatures)
            except InterruptProcessingException as e:
                result.status, result.error = "interrupted", e
            except Exception as e:  # what the server reports as execution_error; the test reads it
                result.status, result.error = "error", e
        return result

    @staticmethod
    def _output_nodes(prompt: dict) -> list[str]:
        from workflow_checks import spec_of

        return [nid for nid, node in prompt.items() if spec_of(node["class_type"]).is_output_node]

    def _signature(self, prompt, nid, signatures) -> tuple:
        if nid not in signatures:
            node = prompt[nid]
            parts = []
            for name, value in sorted(node["inputs"].items()):
                if isinstance(value, list):
                    parts.append((name, self._signature(prompt, str(value[0]), signatures), value[1]))
                else:
                    parts.append((name, repr(value)))
            signatures[nid] = (node["class_type"], tuple(parts))
        return signatures[nid]

    def _evaluate(self, prompt, nid, result: QueueResult, signatures) -> tuple:
        if nid in result.outputs:
            return result.outputs[nid]
        node = prompt[nid]
        signature = self._signature(prompt, nid, signatures)
        hit = self._cache.get(nid)
        if hit is not None and hit[0] == signature:
            result.outputs[nid] = hit[1]
            result.cached.append(nid)
            return hit[1]
        ctype = node["class_type"]
        spec = schema.BY_ID.get(ctype)
        lazy = {i.name for i in spec.inputs if i.lazy} if spec is not None else set()
        values = {}
        for name, value in node["inputs"].items():
            if name in lazy:
                continue
            values[name] = self._resolve(prompt, value, result, signatures)
        if lazy:
            present = {name: None for name in lazy}
            # the sampler's check_lazy_status (comfy_nodes.SDVGSpeculativeSampler): logic.needed_inputs
            for name in logic.needed_inputs(values["mode"], **present, schedule_veto=values.get("schedule_veto", False)):
                if name in node["inputs"]:
                    values[name] = self._resolve(prompt, node["inputs"][name], result, signatures)
        self.interrupt.throw_if_interrupted()  # ComfyUI checks before every node
        if spec is not None:
            services = ExecutorServices(self, nid)
            out = logic.run_node(ctype, services, **values)
            outputs = out.outputs
            if out.ui_text is not None:
                result.ui[nid] = out.ui_text
        else:
            outputs = self._core[ctype](**values)
        result.outputs[nid] = outputs
        result.executed.append(nid)
        self._cache[nid] = (signature, outputs)
        return outputs

    def _resolve(self, prompt, value, result, signatures):
        if isinstance(value, list):
            return self._evaluate(prompt, str(value[0]), result, signatures)[value[1]]
        return value


def _no_text_encoder(text: str) -> torch.Tensor:
    raise ValueError("this executor has no text encoder; pass encode_text=")
