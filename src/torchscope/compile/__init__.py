"""The torch.compile doctor: compile cost, speedup per mode, break-even, graph breaks,
recompiles and compile hygiene.

`compile_report` answers "is torch.compile worth it here?" (`report.findings()` says it in
words); `watch_recompiles` records recompiles and their failing guards in your own loop;
`compile_once`, `compile_guard` and `audit_compiled_hooks` catch the compile-in-a-loop and
late-hook traps. How torchscope's own hooks treat a compiled model lives in
`torchscope.hooks` (`compiled_parts`, `compiled_capture`, `CompiledCheck`). Modules whose
names start with `_` and names not listed here are private.
"""

from torchscope.compile import analyze as _analyze  # registers CompileReport's analyzer
from torchscope.compile.breaks import BreakScan, find_graph_breaks
from torchscope.compile.doctor import DEFAULT_MODES, compile_report, known_modes
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
    CompileReport,
    GraphBreak,
    ModeResult,
    Recompile,
    ShapeCall,
)
from torchscope.compile.watch import RecompileWatcher, watch_recompiles

del _analyze

__all__ = [
    "DEFAULT_MODES",
    "BreakScan",
    "CompileGuard",
    "CompileLoopWarning",
    "CompileReport",
    "GraphBreak",
    "LateHook",
    "ModeResult",
    "Recompile",
    "RecompileWarning",
    "RecompileWatcher",
    "ShapeCall",
    "audit_compiled_hooks",
    "compile_guard",
    "compile_once",
    "compile_report",
    "find_graph_breaks",
    "known_modes",
    "late_hooks",
    "track_compiled",
    "watch_recompiles",
]
