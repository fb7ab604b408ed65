"""Loading a bundle onto a GPU and resolving calls to precompiled kernels.

Nothing here can compile: cubins are loaded with `cuLibraryLoadData`, kernels
are found by the symbol the build read from the compiled object, and a call
resolves by dictionary lookup on its specialization key.
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

import torch
from cuda.bindings import driver

from .abi import ArgBuffer, Signature
from .devices import PROFILES, DeviceProfile, match_profile
from .errors import (
    ArchNotInBundleError,
    BadInputError,
    BundleError,
    LaunchArgumentError,
    LaunchError,
    NoDeviceError,
    UnknownSpecializationError,
)
from .keys import KernelKey
from .manifest import KernelRecord, check_serves, kernel_records, read_cubin, read_manifest
from .plans import BundlePlans
from .resolution import ResolutionTable
from .workspace import WorkspacePool

_DEFAULT_DYNAMIC_SMEM_LIMIT = 48 * 1024


def check_cu(result: tuple, what: str):
    """Unpack a cuda-python result tuple, raising LaunchError on any CUresult but success."""
    err, *values = result
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise LaunchError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _env_choice(name: str) -> bool | None:
    """An on / off / auto environment setting: 1 true yes on, 0 false no off, or unset / auto (None)."""
    value = os.environ.get(name, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    if value not in ("", "auto"):
        warnings.warn(f"{name}={value!r} is not 1, 0 or auto: taken as auto", stacklevel=2)
    return None


class _LaunchSettings:
    # Programmatic dependent launch (PDL): a kernel whose PTX waits for the grids before it
    # (KernelRecord.waits_for_prior_grids) is launched with programmatic stream serialization, so its
    # CTAs launch while the kernel before it on the stream drains instead of after; on by default,
    # CUTEAOT_PDL=0 turns it off (benchmarks/pdl_ab.py compares the two).
    programmatic = os.environ.get("CUTEAOT_PDL", "1") != "0"
    # Cooperative launch: a kernel whose CTAs wait on each other (grid barriers, split-K turns;
    # LoadedKernel.waits_on_grid) launched as a cooperative grid is made co-resident as a whole by the
    # GPU.  A plain launch is co-resident only where nothing else runs: beside another stream's such
    # grid, part of each may start and spin at its barrier while the rest waits for SMs the other
    # holds, and both hang (benchmarks/concurrent_barriers.py: two streams of layers hung on an H100).
    # A cooperative grid waits for the whole GPU instead, which costs a full-GPU grid a few us.  So by
    # default (None) a bundle's such kernels launch cooperatively once one of its layers reserved
    # streams (`MoeLayer.reserve`: layers declared to run concurrently), plainly before; True / False
    # (CUTEAOT_COOPERATIVE=1 / 0, or set_cooperative_launch) decide for every launch.
    cooperative = _env_choice("CUTEAOT_COOPERATIVE")
    # bumped whenever anything launch_mode reads changes: a kernel recomputes its cached mode only then
    generation = 0


class LaunchState:
    """What one bundle's launches depend on beyond the kernel: `concurrent` once a layer reserved streams."""

    __slots__ = ("_concurrent",)

    def __init__(self) -> None:
        self._concurrent = False

    @property
    def concurrent(self) -> bool:
        return self._concurrent

    @concurrent.setter
    def concurrent(self, value: bool) -> None:
        self._concurrent = bool(value)
        _LaunchSettings.generation += 1  # every kernel's cached launch mode is stale


def set_programmatic_launch(enabled: bool) -> bool:
    """Launch kernels that wait for their predecessors with programmatic stream serialization (True,
    the default unless CUTEAOT_PDL=0) or plainly; returns the previous setting.  A CUDA graph keeps
    what was set while it was captured."""
    previous, _LaunchSettings.programmatic = _LaunchSettings.programmatic, bool(enabled)
    _LaunchSettings.generation += 1
    return previous


def set_cooperative_launch(enabled: bool | None) -> bool | None:
    """Launch kernels whose CTAs wait on each other as cooperative grids (True), plainly (False), or
    cooperatively once their bundle's layers reserved streams for concurrent calls (None, the default
    unless CUTEAOT_COOPERATIVE is 1 or 0); returns the previous setting.  A CUDA graph keeps what was
    set while it was captured."""
    if not (enabled is True or enabled is False or enabled is None):
        raise BadInputError(f"set_cooperative_launch takes True, False or None, got {enabled!r}")
    previous, _LaunchSettings.cooperative = _LaunchSettings.cooperative, enabled
    _LaunchSettings.generation += 1
    return previous


def _launch_config(kernel: "LoadedKernel", programmatic: bool, cooperative: bool) -> driver.CUlaunchConfig:
    """A launch configuration with kernel's block, shared memory and the chosen attributes."""
    attrs = []
    if programmatic:
        attribute = driver.CUlaunchAttribute()
        attribute.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attribute.value.programmaticStreamSerializationAllowed = 1
        attrs.append(attribute)
    if cooperative:
        attribute = driver.CUlaunchAttribute()
        attribute.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
        attribute.value.cooperative = 1
        attrs.append(attribute)
    config = driver.CUlaunchConfig()
    config.blockDimX, config.blockDimY, config.blockDimZ = kernel.block
    config.gridDimY = config.gridDimZ = 1
    config.sharedMemBytes = kernel.smem
    config.attrs = attrs
    config.numAttrs = len(attrs)
    return config


def launch_mode(kernel: "LoadedKernel") -> int:
    """How `kernel` launches now: 0 plainly, + 1 programmatic (PDL), + 2 cooperative (see _LaunchSettings)."""
    if not (kernel.programmatic or kernel.waits_on_grid):
        return 0
    cooperative = _LaunchSettings.cooperative
    return (bool(kernel.programmatic and _LaunchSettings.programmatic)
            + 2 * bool(kernel.waits_on_grid and (kernel.state.concurrent if cooperative is None else cooperative)))


def _cu_launch(kernel: "LoadedKernel", grid_x: int, stream: int, params: int) -> None:
    """One launch of `kernel` with the packed parameter array at `params`."""
    if kernel._mode_generation == _LaunchSettings.generation:  # (one test on the hot path)
        mode = kernel._mode
    else:
        kernel._mode, kernel._mode_generation = launch_mode(kernel), _LaunchSettings.generation
        mode = kernel._mode
    if mode:
        try:
            launch = kernel._tls.configs[mode]
        except AttributeError:  # (this thread's first launch of the kernel with attributes)
            kernel._tls.configs = [None] * 4
            launch = None
        if launch is None:
            launch = kernel._tls.configs[mode] = [_launch_config(kernel, bool(mode & 1), bool(mode & 2)), None]
        config = launch[0]
        if launch[1] != (grid_x, stream):  # the driver struct's setters cost more than this test
            config.gridDimX = grid_x
            config.hStream = stream
            launch[1] = (grid_x, stream)
        (err,) = driver.cuLaunchKernelEx(config, kernel.function, params, 0)
    else:
        bx, by, bz = kernel.block
        (err,) = driver.cuLaunchKernel(kernel.function, grid_x, 1, 1, bx, by, bz, kernel.smem, stream, params, 0)
    if err:  # CUresult is an int; CUDA_SUCCESS == 0
        try:
            check_cu((err,), f"launching {kernel.record.symbol} (grid=({grid_x}, 1, 1)"
                             f"{', cooperative' if mode & 2 else ''})")
        except LaunchError as exc:
            hint = _context_hint(kernel)
            if not hint:
                raise
            raise LaunchError(f"{exc}{hint}") from None


def _context_hint(kernel: "LoadedKernel") -> str:
    """Why a launch may have failed where another device's context is current (a process driving several
    GPUs): the kernel's function belongs to its bundle's device.  Asked only after a failure."""
    err, current = driver.cuCtxGetCurrent()
    if err or int(current or 0) == int(kernel.context or 0):
        return ""
    return ("; another device's CUDA context is current, and the kernel was loaded for its bundle's device: call "
            "the layer under `with torch.cuda.device(bundle.device):` (or torch.cuda.set_device once per process)")


def current_stream_handle(device_index: int) -> int:
    """The raw `cudaStream_t` of torch's current stream on the device."""
    if _raw_stream is not None:
        return _raw_stream(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


class LoadedKernel:
    """A kernel loaded into one device's context, ready to launch."""

    def __init__(self, record: KernelRecord, function, context, state: LaunchState | None = None):
        self.record = record
        self.function = function
        self.context = context  # the device's primary context the function belongs to
        self.block = record.block
        self.smem = record.dynamic_smem_bytes
        self.programmatic = record.waits_for_prior_grids
        # its CTAs wait on each other: marked by the family that knows (PersistentLaunch, route packing)
        self.waits_on_grid = False
        self.state = LaunchState() if state is None else state  # its bundle's
        self._mode, self._mode_generation = 0, -1  # launch_mode, cached for _LaunchSettings.generation
        self._tls = threading.local()

    def mark_waits_on_grid(self) -> None:
        """Its CTAs wait on each other (grid barriers, split-K turns): launched cooperatively where layers
        run concurrently (launch_mode)."""
        self.waits_on_grid = True
        self._mode_generation = -1  # its cached launch mode is stale

    def bind(self, signature: Signature) -> None:
        """Declare the runtime's signature for this kernel; refuses one the build did not check."""
        if not signature.matches_json(self.record.params):
            raise BundleError(
                f"kernel {self.record.key.describe()} was built with parameters {self.record.params}, "
                f"but this runtime declares {signature.to_json()}; rebuild the bundle"
            )
        self._signature = signature
        self._getter, self._count = signature.getter, len(signature.params)

    def _new_thread_buffer(self) -> ArgBuffer:
        """An argument buffer for the calling thread: threads never share one, since cuLaunchKernel releases
        the GIL while it reads the arguments.  A thread that has not touched CUDA yet has no current
        context (torch binds one lazily): the device's primary context is bound first, as torch would."""
        if not int(check_cu(driver.cuCtxGetCurrent(), "cuCtxGetCurrent") or 0):
            check_cu(driver.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        return ArgBuffer(self._signature)

    def _issue_packed(self, grid_x: int, stream: int, buffer: ArgBuffer) -> None:
        """Launch with the arguments already in `buffer`."""
        _cu_launch(self, grid_x, stream, buffer.address)

    def prepare(self, variables: tuple[str, ...], **constants: int | float) -> "PreparedLaunch":
        """A launch of this kernel with `constants` fixed; each call passes only `variables`, in order."""
        return PreparedLaunch(self, variables, constants)

    def launch(self, grid_x: int, stream: int, /, **values: int | float) -> None:
        """Launch on `stream` with a (grid_x, 1, 1) grid; `values` by the parameter names of `bind`'s signature.

        Every declared parameter must be passed, by name (LaunchArgumentError otherwise), so
        an argument cannot land in another parameter's slot.
        """
        # Signature.order, inlined: this runs on every launch of a serving step
        try:
            ordered = self._getter(values)
        except KeyError:
            raise self._signature.mismatch(values) from None
        if len(values) != self._count:
            raise self._signature.mismatch(values)
        recording = _RECORDING.launches
        if recording is not None:  # binding a call: keep the launch, issue nothing (runtime/bound.py)
            recording.append(RecordedLaunch(self, grid_x, stream, ordered))
            return
        self._issue(grid_x, stream, ordered)

    def _issue(self, grid_x: int, stream: int, ordered) -> None:
        """Pack the values (declaration order) into this thread's buffer and launch."""
        try:
            buf = self._tls.buf
        except AttributeError:  # (this thread's first launch of the kernel)
            buf = self._tls.buf = self._new_thread_buffer()
        buf.pack(*ordered)
        self._issue_packed(grid_x, stream, buf)


class _Recording(threading.local):
    """.launches: a list while a call is being bound on this thread, else None.  The class default makes
    the per-launch test one attribute read (a missing thread-local attribute costs ~0.4 us to look up)."""

    launches: list | None = None


_RECORDING = _Recording()


class PreparedLaunch:
    """A kernel's launch with the arguments that do not change between calls already in place.

    `LoadedKernel.prepare(variables, **constants)`: every declared parameter is named once,
    either as a constant or as a variable (LaunchArgumentError otherwise), and a call passes
    only the variables' values, positionally in the order given.  For the per-step launches of
    a layer, whose weight and workspace pointers are fixed: each thread keeps its own argument
    buffer with the constants packed once, and a call stores only the variables into it
    (`ArgBuffer.writer`), instead of looking up or packing every parameter.
    """

    __slots__ = ("kernel", "_template", "_slots", "_tls")

    def __init__(self, kernel: LoadedKernel, variables: tuple[str, ...], constants: dict):
        signature = kernel._signature
        twice = sorted(set(variables) & set(constants)) + sorted({v for v in variables if variables.count(v) > 1})
        if twice:
            raise LaunchArgumentError(f"a prepared launch names each parameter once; named twice: {twice}")
        named = dict(constants, **dict.fromkeys(variables, 0))
        self._template = signature.order(named)  # LaunchArgumentError unless every name is there once
        self._slots = tuple(signature.names.index(v) for v in variables)
        self._tls = threading.local()  # .state: this thread's (write, buffer)
        self.kernel = kernel

    def launch(self, grid_x: int, stream: int, /, *values: int | float) -> None:
        recording = _RECORDING.launches
        if recording is not None:  # binding a call: keep the launch, issue nothing
            recording.append(RecordedLaunch(self.kernel, grid_x, stream, self._ordered(values)))
            return
        try:
            write, buffer = self._tls.state
        except AttributeError:  # (this thread's first launch of it)
            write, buffer = self._tls.state = self._thread_buffer()
        try:
            write(*values)
        except (TypeError, ValueError) as exc:
            self._ordered(values)  # names a wrong count
            raise LaunchArgumentError(f"launch values {values} do not fit the parameters "
                                      f"{[self.kernel._signature.names[i] for i in self._slots]}: {exc}") from None
        self.kernel._issue_packed(grid_x, stream, buffer)

    def _ordered(self, values: tuple) -> tuple:
        """Every parameter's value in declaration order: the constants with `values` at the variables' slots."""
        if len(values) != len(self._slots):
            raise LaunchArgumentError(f"this prepared launch of {len(self._template)} parameters takes "
                                      f"{len(self._slots)} values, got {len(values)}")
        ordered = list(self._template)
        for slot, value in zip(self._slots, values):
            ordered[slot] = value
        return tuple(ordered)

    def _thread_buffer(self) -> tuple:
        buffer = self.kernel._new_thread_buffer()
        buffer.pack(*self._template)
        return buffer.writer(self._slots), buffer


class RecordedLaunch:
    """One kernel launch of a bound call: function, grid and its own packed argument buffer."""

    __slots__ = ("kernel", "grid_x", "stream", "buffer")

    def __init__(self, kernel: LoadedKernel, grid_x: int, stream: int, ordered: tuple):
        self.kernel, self.grid_x, self.stream = kernel, grid_x, stream
        self.buffer = ArgBuffer(kernel._signature)  # owned by this launch: the values never change
        self.buffer.pack(*ordered)

    def launch(self, stream: int) -> None:
        _cu_launch(self.kernel, self.grid_x, stream, self.buffer.address)


class ZeroFill:
    """Zeroing `words` 32-bit words at a device address on a stream (cuMemsetD32Async): the output of a
    layer whose FC2 adds its rows into it.  Issued at once, or, while a call is being bound, recorded
    with the launches so that the bound call zeroes before it launches."""

    __slots__ = ("address", "words")

    def __init__(self, address: int, words: int):
        self.address, self.words = address, words

    def issue(self, stream: int) -> None:
        recording = _RECORDING.launches
        if recording is not None:
            recording.append(self)
            return
        self.launch(stream)

    def launch(self, stream: int) -> None:
        (err,) = driver.cuMemsetD32Async(self.address, 0, self.words, stream)
        if err:
            check_cu((err,), f"cuMemsetD32Async({self.address:#x}, 0, {self.words})")


class recording_launches:
    """Within this block, LoadedKernel.launch on this thread records instead of launching."""

    def __enter__(self) -> list[RecordedLaunch]:
        if _RECORDING.launches is not None:
            raise LaunchError("binding calls do not nest")
        _RECORDING.launches = []
        return _RECORDING.launches

    def __exit__(self, *exc) -> None:
        _RECORDING.launches = None


class Bundle:
    """A bundle's kernels for one device, loaded and indexed by specialization key."""

    def __init__(self, path: Path, manifest: dict, profile: DeviceProfile, device: torch.device):
        self.path = path
        self.manifest = manifest
        self.name: str = manifest["bundle"]
        self.profile = profile
        self.arch = profile.arch
        self.device = device
        self.device_index: int = device.index
        self.id = f"{self.name}@{path.resolve()}#cuda:{device.index}"
        self._kernels: dict[str, LoadedKernel] = {}
        self._libraries: list = []
        self.resolution = ResolutionTable.from_manifest(manifest, profile.name)  # the build's decisions
        self.plans = BundlePlans()  # launch plans resolved once (host state only)
        self.gemm_workspaces: dict[int, object] = {}  # w4a16_moe_gemm's own scratch, per raw stream
        self.captured_gemm_workspaces: list = []  # ones a CUDA graph launched on, replaced since: kept alive
        self.workspaces = WorkspacePool(device)  # MoE layers' scratch memory, reserved before serving
        self.launch_state = LaunchState()  # shared by its kernels: concurrent once a layer reserved streams

    # -- loading ----------------------------------------------------------------
    def _load(self, records: list[KernelRecord]) -> None:
        context = check_cu(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
        for record in records:
            data = read_cubin(self.path, record)
            library = check_cu(
                driver.cuLibraryLoadData(data, None, None, 0, None, None, 0),
                f"cuLibraryLoadData({record.file})",
            )
            self._libraries.append(library)
            kernel = check_cu(
                driver.cuLibraryGetKernel(library, record.symbol.encode()),
                f"cuLibraryGetKernel({record.symbol})",
            )
            function = check_cu(driver.cuKernelGetFunction(kernel), f"cuKernelGetFunction({record.symbol})")
            self._check_function(function, record)
            self._kernels[record.digest] = LoadedKernel(record, function, context, self.launch_state)

    def _check_function(self, function, record: KernelRecord) -> None:
        attr = driver.CUfunction_attribute
        regs = check_cu(driver.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_NUM_REGS, function), "cuFuncGetAttribute")
        if regs != record.registers:
            raise BundleError(
                f"{record.file}: the driver reports {regs} registers for {record.symbol}, the manifest "
                f"{record.registers}; the bundle does not describe its own cubin"
            )
        if record.dynamic_smem_bytes:
            # Kernels with dynamic shared memory (the GEMM) are planned for several CTAs per SM:
            # prefer the largest shared-memory carveout so that many fit.
            check_cu(
                driver.cuFuncSetAttribute(function, attr.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100),
                f"setting the shared memory carveout of {record.symbol}",
            )
        if record.dynamic_smem_bytes > _DEFAULT_DYNAMIC_SMEM_LIMIT:
            check_cu(
                driver.cuFuncSetAttribute(
                    function, attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, record.dynamic_smem_bytes
                ),
                f"raising the dynamic shared memory limit of {record.symbol}",
            )

    # -- resolution -------------------------------------------------------------
    def kernel(self, key: KernelKey) -> LoadedKernel:
        """The loaded kernel for `key`, or UnknownSpecializationError naming the nearest built."""
        found = self._kernels.get(key.digest)
        if found is None:
            raise self._unknown(key)
        return found

    def kernel_by_digest(self, digest: str) -> LoadedKernel:
        """The loaded kernel a resolution-table entry names (verify_bundle checked that it exists)."""
        found = self._kernels.get(digest)
        if found is None:
            raise BundleError(
                f"bundle {self.name!r} ({self.path}): its resolution table names kernel {digest[:12]}, which is not "
                f"loaded for {self.arch}; the bundle is inconsistent: rebuild it"
            )
        return found

    def has(self, key: KernelKey) -> bool:
        return key.digest in self._kernels

    def _unknown(self, key: KernelKey) -> UnknownSpecializationError:
        same_family = [k.record.key for k in self._kernels.values() if k.record.key.family == key.family]
        scored = []
        for other in same_family:
            names = set(key.facts) | set(other.facts)
            diff = {n: other.facts.get(n) for n in sorted(names) if key.facts.get(n) != other.facts.get(n)}
            scored.append((len(diff), other.canonical, diff))
        scored.sort(key=lambda t: (t[0], t[1]))
        lines = [f"  differs in {d}" for _, _, d in scored[:3]]
        nearest = "\n".join(lines) if lines else f"  (the bundle has no {key.family} kernels for {self.arch})"
        return UnknownSpecializationError(
            f"bundle {self.name!r} ({self.path}) has no kernel {key.describe()} for {self.arch}.\n"
            f"Nearest built specializations:\n{nearest}\n"
            "Add the problem (or option) to the bundle's spec and rebuild it (`cuteaot build SPEC --out DIR`)."
        )

    def __len__(self) -> int:
        return len(self._kernels)

    def __repr__(self) -> str:
        return f"Bundle({self.name!r}, {self.arch}, {len(self)} kernels, profile={self.profile.name})"


_BUNDLES: dict[str, Bundle] = {}


def registered_bundle(bundle_id: str) -> Bundle:
    """The loaded bundle with this id (torch custom ops refer to bundles by id)."""
    try:
        return _BUNDLES[bundle_id]
    except KeyError:
        raise BundleError(f"no bundle with id {bundle_id!r} is loaded in this process") from None


def load_bundle(path: str | Path, device: torch.device | str | int | None = None) -> Bundle:
    """Load the kernels of a bundle for the given (default: current) CUDA device.

    Checks the schema version, matches the live GPU to one of the bundle's device
    profiles, verifies the sha256 of every cubin it loads and loads them with
    `cuLibraryLoadData`.  Never compiles anything.
    """
    path = Path(path)
    manifest = read_manifest(path)
    if not torch.cuda.is_available():
        raise NoDeviceError("no CUDA device is visible; a bundle can be verified (`cuteaot verify`) but not loaded")
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if device.type != "cuda":
        raise NoDeviceError(f"bundles load onto CUDA devices, got {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(device)
    targets = [PROFILES[t["name"]] for t in manifest["targets"] if t["name"] in PROFILES]
    profile = match_profile(
        targets,
        name=props.name,
        capability=(props.major, props.minor),
        sm_count=props.multi_processor_count,
    )
    if profile is None:
        raise ArchNotInBundleError(
            f"bundle {manifest['bundle']!r} targets {[t['name'] for t in manifest['targets']]}, none of which "
            f"matches the live GPU {props.name!r} (sm_{props.major}{props.minor}, {props.multi_processor_count} SMs); "
            "add its profile to the spec's targets and rebuild"
        )
    check_serves(manifest, profile)
    records = [r for r in kernel_records(manifest) if r.arch == profile.arch]
    bundle = Bundle(path, manifest, profile, device)
    with torch.cuda.device(device):
        torch.empty(1, device=device)  # make torch create (and bind) the primary context
        bundle._load(records)
    _BUNDLES[bundle.id] = bundle
    return bundle
