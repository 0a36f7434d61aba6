"""Where a jitted CPU program's time goes: JAX's profiler traces a few calls, and each XLA operation's
own time (its nested operations' time taken out) is put in a category by what the operation is and
by the source lines it was traced from (the compiled HLO's stack frames).

    hlo = jitted.lower(*args).compile().as_text()
    shares = breakdown(run, hlo, calls=5)   # {category: ms per call}, with "wall", "busy", "places"

Categories, in the order they are decided:
- "optimiser": traced from optax (its losses excepted) or from train/step.py after the micro-batch
  loop (gradient scaling, norms, finiteness);
- "attention fwd" / "attention bwd": traced from kernels/attention or its CPU kernels' custom calls (products
  included, as PyTorch's scaled_dot_product_attention is one kernel), backward when traced under a transpose;
- "products": dot fusions (the YNNPACK/XNNPACK/oneDNN matmul fusions, dot, convolution) and the grouped
  products' custom calls (kernels/grouped);
- "copies": fusions of copies, transposes, bitcasts, slices, pads and concatenations only;
- "loops": the while and conditional operations' own time (their bodies are counted where they belong);
- "fusions": every other fusion (elementwise and reduction work: norms, rotary, the loss, gates) and the other
  custom calls (the SSD's CPU kernels, kernels/ssd, their products included);
- "idle": the call's wall time less the time at least one thread ran an operation (dispatch, waits
  between operations on the runtime's threads). A product XLA runs with Eigen (an operation `dot`, the
  ones YNNPACK does not take: the weight gradients, contracting over tokens) records an event for
  only part of its time, and its work goes on in the thread pool unrecorded: the gap after it, before
  the next operation starts, is counted to it.
Operations run on the runtime's threads at once, so the categories sum to more than "busy", the time
when at least one ran. The profiler adds a little to every operation: read the shares, not the sums.
`places` names where the most time goes: (file, direction, category) -> ms.
"""

import collections
import re
import tempfile
import time
from pathlib import Path

import jax

SECTIONS = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
LAYOUT_OPS = {"copy", "transpose", "bitcast", "slice", "pad", "concatenate", "reshape", "broadcast", "dynamic-slice",
              "dynamic-update-slice"}
CATEGORIES = ("products", "attention fwd", "attention bwd", "fusions", "optimiser", "copies", "loops", "idle")


def _frames(hlo: str) -> dict:
    """stack_frame_id -> [(file, line), ...] innermost first, from the compiled HLO's tables."""
    tables = {s: {} for s in SECTIONS}
    section = None
    for line in hlo.splitlines():
        s = line.strip()
        if s in tables:
            section = s
        elif section and re.match(r"\d+ ", s):
            i, rest = s.split(" ", 1)
            tables[section][int(i)] = rest
        elif section:
            section = None
    files = {i: v.strip('"') for i, v in tables["FileNames"].items()}
    num = lambda text, key: int(re.search(key + r"=(\d+)", text).group(1))
    locs = {i: (files[num(v, "file_name_id")], num(v, "line")) for i, v in tables["FileLocations"].items()}
    parents = {i: (num(v, "file_location_id"), num(v, "parent_frame_id")) for i, v in tables["StackFrames"].items()}

    def stack(f):
        out = []
        while f in parents and len(out) < 64:
            loc, parent = parents[f]
            out.append(locs[loc])
            f = parent if parent != f else -1
        return out

    return {f: stack(f) for f in parents}


def operations(hlo: str) -> dict:
    """Each named operation of the compiled HLO: name -> (category with its direction, the file it
    was traced from, the line)."""
    frames = _frames(hlo)
    out = {}
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*? ([\w\-]+)\(", line)
        if not m:
            continue
        name, opcode = m.groups()
        frame = re.search(r"stack_frame_id=(\d+)", line)
        stack = frames.get(int(frame.group(1)), []) if frame else []
        op_name = (re.search(r'op_name="([^"]*)"', line) or [None, ""])[1]
        backward = "transpose(" in op_name
        out[name] = (_category(name, opcode, line, stack, op_name), *_place(stack, line), backward)
    return out


def _category(name, opcode, line, stack, op_name) -> str:
    files = [f for f, _ in stack]
    update = files and files[0].endswith("train/step.py") and op_name.startswith("jit(step)/") \
        and "/while/body/" not in op_name  # after the micro-batch loop
    if any("optax" in f and "losses" not in f for f in files) or update:
        return "optimiser"
    if any("kernels/attention" in f for f in files) or 'custom_call_target="zoo_attention' in line:
        return "attention bwd" if "transpose(" in op_name else "attention fwd"
    if opcode in ("dot", "convolution") or re.search(r'"kind":"__(ynn|xnn|onednn)', line) or name.startswith("dot") \
            or 'custom_call_target="zoo_grouped' in line:
        return "products"
    if opcode in ("while", "conditional"):
        return "loops"
    parts = set(name.split(".")[0].replace("_fusion", "").split("_")) - {"wrapped", ""}
    if opcode in LAYOUT_OPS or opcode == "fusion" and parts <= {p.replace("-", "") for p in LAYOUT_OPS}:
        return "copies"
    return "fusions"


def _place(stack, line: str) -> tuple[str, int]:
    """A CPU kernel's custom call target (kernels/native.py calls them all), else the innermost frame in this
    project (not a library's): (path from the project root, line)."""
    target = re.search(r'custom_call_target="(zoo_\w+)"', line)
    if target:
        return target[1], 0  # (no line)
    root = str(Path(__file__).resolve().parents[1]) + "/"
    for f, n in stack:
        if f.startswith(root) and "site-packages" not in f:
            return f[len(root):], n
    return (stack[0][0].rsplit("site-packages/", 1)[-1], stack[0][1]) if stack else ("?", 0)


def _exclusive(profile) -> tuple[collections.Counter, list, list]:
    """Each operation's own time (ns, nested operations taken out) over the runtime threads, the
    (start, end, name) of every leaf operation, and the (start, end) of each call's execution."""
    own, leaves, calls = collections.Counter(), [], []
    for plane in profile.planes:
        for line in plane.lines:
            if line.name == "python":
                continue
            calls += [(e.start_ns, e.start_ns + e.duration_ns) for e in line.events
                      if e.name.startswith("ThunkExecutor::Execute (wait")]
            events = sorted(((e.start_ns, e.duration_ns, e.name) for e in line.events
                             if not e.name.startswith("end:") and "::" not in e.name), key=lambda e: (e[0], -e[1]))
            open_ = []  # [name, end, has children, start]
            for start, dur, name in events:
                while open_ and open_[-1][1] <= start:
                    done = open_.pop()
                    if not done[2]:
                        leaves.append((done[3], done[1], done[0]))
                if open_:
                    own[open_[-1][0]] -= dur
                    open_[-1][2] = True
                own[name] += dur
                open_.append([name, start + dur, False, start])
            leaves += [(o[3], o[1], o[0]) for o in open_ if not o[2]]
    return own, leaves, calls


def _gaps(leaves, calls) -> tuple[float, collections.Counter]:
    """(ns when at least one leaf ran, ns of each gap inside a call by the leaf that ended last before it)."""
    busy, gaps, end, last = 0.0, collections.Counter(), -float("inf"), None
    inside = lambda a, b: any(lo <= a and b <= hi for lo, hi in calls)
    for s, e, name in sorted(leaves):
        if s > end and last is not None and inside(end, s):
            gaps[last] += s - end
        busy += max(0.0, e - max(s, end))
        if e > end:
            end, last = e, name
    return busy, gaps


def breakdown(run, hlo: str, calls: int = 5, places: int = 10) -> dict:
    """ms per call by category (CATEGORIES) of `run()`, one blocking call of the program compiled as
    `hlo`, with "wall" and "busy", and "places": the `places` (file:line, direction, category) that take most."""
    ops = operations(hlo)
    run()
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            t0 = time.perf_counter()
            for _ in range(calls):
                run()
            wall = (time.perf_counter() - t0) / calls
        profile = jax.profiler.ProfileData.from_file(str(next(Path(d).rglob("*.xplane.pb"))))
    own, leaves, executions = _exclusive(profile)
    busy, gaps = _gaps(leaves, executions)
    for name, ns in gaps.items():  # an Eigen product's work on the thread pool, after its event
        if re.fullmatch(r"dot(_general)?(\.\d+)?", name):
            own[name] += ns
            busy += ns
    out, where = collections.Counter(), collections.Counter()
    for name, ns in own.items():
        category, file, line, backward = ops.get(name, ("fusions", "?", 0, False))
        out[category] += ns / 1e6 / calls
        where[(f"{file}:{line}" if line else file, "bwd" if backward else "fwd", category)] += ns / 1e6 / calls
    busy /= 1e6 * calls
    out["idle"] = max(0.0, wall * 1e3 - busy)
    return {**{c: round(out[c], 1) for c in CATEGORIES}, "wall": round(wall * 1e3, 1), "busy": round(busy, 1),
            "places": [(p, round(ms, 1)) for p, ms in where.most_common(places)]}
