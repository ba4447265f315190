"""The torch.compile doctor: compile cost, speedup per mode, break-even, graph breaks,
recompiles, compile hygiene, and safe torchscope captures on compiled models."""

from torchscope.compile.analyze import compile_findings, recompile_findings
from torchscope.compile.breaks import BreakScan, find_graph_breaks
from torchscope.compile.doctor import DEFAULT_MODES, compile_report, cpp_compiler, known_modes
from torchscope.compile.guard import (
    CompiledCapture,
    check_compiled,
    compiled_capture,
    compiled_parts,
    unwrap_compiled,
)
from torchscope.compile.hygiene import (
    CompileGuard,
    CompileLoopWarning,
    LateHook,
    RecompileWarning,
    audit_compiled_hooks,
    compile_guard,
    compile_once,
    late_hooks,
    track_compiled,
)
from torchscope.compile.records import (
    CompiledCheck,
    CompileReport,
    GraphBreak,
    ModeResult,
    Recompile,
    ShapeCall,
    derive_speed,
)
from torchscope.compile.watch import RecompileWatcher, recompile_limit, watch_recompiles

__all__ = [
    "DEFAULT_MODES",
    "BreakScan",
    "CompileGuard",
    "CompileLoopWarning",
    "CompileReport",
    "CompiledCapture",
    "CompiledCheck",
    "GraphBreak",
    "LateHook",
    "ModeResult",
    "Recompile",
    "RecompileWarning",
    "RecompileWatcher",
    "ShapeCall",
    "audit_compiled_hooks",
    "check_compiled",
    "compile_findings",
    "compile_guard",
    "compile_once",
    "compile_report",
    "compiled_capture",
    "compiled_parts",
    "cpp_compiler",
    "derive_speed",
    "find_graph_breaks",
    "known_modes",
    "late_hooks",
    "recompile_findings",
    "recompile_limit",
    "track_compiled",
    "unwrap_compiled",
    "watch_recompiles",
]
