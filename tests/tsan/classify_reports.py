#!/usr/bin/env python3
"""Sorts ThreadSanitizer's reports (`./dev tsan`) into ours and gRPC's; exits 1 when any is ours.

gRPC's core, protobuf and abseil come uninstrumented from Debian, so TSan never sees the ordering their completion
queues and atomics give: every message gRPC fills on one thread and a reactor reads on another looks like a race. A
report is put down to that when some access in it was made by their code: the first frame of its stack outside the C and
C++ libraries is in grpcpp's headers, gRPC's, protobuf's or abseil's libraries, abseil's Status (its reference count),
generated protobuf code, or upb (gRPC core's own protobuf runtime). The preloaded annotations of abseil's
synchronization (absl_mutex_annotations.cc) are passed over like the C++ library, so that an access they make to a mutex
is put down to the code that locked, unlocked or destroyed it: a mutex of ours freed under another thread's lock is
ours. A race between an object's allocation (or a mutex's creation, whose stack TSan may have lost) and an access in a
call gRPC made is gRPC's too (the creation as the annotations record it, or as a plain write to the mutex's word):
gRPC handed the object over (a reactor it calls back). A race whose accesses were all made
by this project's code, and every report of another kind (lock-order inversions, mutex misuse, a crash), is ours and
printed whole. A data race report that the process's end cut off before naming any code (the last of its file, without
its SUMMARY line: a daemon killed while TSan wrote it; what it wrote holds no frame but the C and C++ libraries' and the
sanitizer's, such as the interceptor of the call that read) names no code to blame and is set aside too. The summary counts the
reports set aside under the rule that set each aside.

Usage: classify_reports.py REPO_ROOT BUILD_DIR REPORT_FILE...
"""
import collections
import re
import sys

FRAME = re.compile(r"^\s+#\d+ (?P<func>.*?) (?P<where>\S+) \((?P<module>[^)]*)\)$")
STACK_HEAD = re.compile(r"^  (Write|Read|Previous write|Previous read|Atomic \S+|Previous atomic \S+|Mutex \S+ acquired"
                        r"|Mutex \S+ previously acquired)")
ACCESS = re.compile(r"^  (?P<kind>.+?) of size (?P<size>\d+) at (?P<address>0x[0-9a-f]+)")
LIBRARY = ("/usr/include/c++/", "libsanitizer", "libtsan.so", "libstdc++.so", "libc.so", "libm.so",
           "libabsl_tsan_annotations.so")
# gRPC core's libraries as Debian's libgrpc29 ships them: upb is the protobuf runtime its core parses messages with.
GRPC = ("/usr/include/grpcpp/", "/usr/include/grpc/", "libgrpc", "libupb", "libaddress_sorting")
ALLOCATION = ("operator new", "malloc", "calloc", "realloc", "posix_memalign", "aligned_alloc")
# abseil's status header too: a Status's reference count is dropped inside the library as often as in the header.
THEIRS = GRPC + ("/usr/include/google/protobuf/", "libgpr", "libprotobuf", ".pb.cc", ".pb.h", "libabsl",
                 "/usr/include/absl/status/")


def reports(path):
    text = open(path, errors="replace").read()
    for block in text.split("==================\n"):
        if "WARNING: ThreadSanitizer:" in block or "ERROR: ThreadSanitizer:" in block:  # ERROR: a crash
            yield block


def access_stacks(block):
    """Each access as (its heading line, its stack), the stack innermost frame first, each frame (function,
    "file:line module"); a stack TSan failed to restore is empty."""
    stacks, in_stack = [], False
    for line in block.splitlines():
        if STACK_HEAD.match(line):
            in_stack = True
            stacks.append((line, []))
            continue
        if not line.strip():
            in_stack = False
            continue
        match = FRAME.match(line)
        if in_stack and match:
            stacks[-1][1].append((match["func"], match["where"] + " " + match["module"]))
    return stacks


def first_frame(stack):
    """The first frame outside the C++ library and the annotations, or None."""
    return next((where for _, where in stack if not any(part in where for part in LIBRARY)), None)


def creates_a_mutex(accesses):
    """One access creates the mutex another access locks or unlocks through the annotations: the annotations' own
    record of its constructor (`__tsan_mutex_create`), or a plain write of 8 bytes to its word. Once a mutex exists,
    only abseil's uninstrumented code writes its word, so that write is the mutex's allocation or its inline
    constructor, even where TSan lost the write's stack."""
    heads = [(ACCESS.match(head), stack) for head, stack in accesses]

    def annotation(stack):
        return stack[0][0] if stack and stack[0][0].startswith("__tsan_mutex_") else None

    locked = {head["address"] for head, stack in heads
              if head and annotation(stack) and annotation(stack) != "__tsan_mutex_create"}
    return any(head and head["address"] in locked
               and (annotation(stack) == "__tsan_mutex_create"
                    or head["kind"] in ("Write", "Previous write") and head["size"] == "8")
               for head, stack in heads)


# The rules that set a report aside, as the summary names them.
THEIR_ACCESS = "with an access made by uninstrumented gRPC, protobuf or abseil code"
HANDED_OVER_OBJECT = "between an object's allocation and a call gRPC made"
HANDED_OVER_MUTEX = "between a mutex's creation and a call gRPC made"
CUT_SHORT = "cut off before naming any code as their process ended"


def cut_short(block, last_in_file):
    """A data race report TSan had not finished writing when its process was killed: the last of its file, without
    its SUMMARY line, and no frame written yet outside the C and C++ libraries and the sanitizer (a report cut off in
    its first stack's interceptor frames names no code)."""
    return (last_in_file and "ThreadSanitizer: data race" in block and "SUMMARY: ThreadSanitizer" not in block
            and not any(first_frame(stack) for _, stack in access_stacks(block)))


def handed_over_by_grpc(accesses):
    """The handover rule's name where one access creates the object (its allocation, or a mutex's creation) and
    another runs in a call gRPC made, else None: the object reached that thread through gRPC (a reactor it calls back),
    whose ordering TSan cannot see. Had our code passed the pointer on without ordering, the pointer's own race would
    be reported, between our accesses."""
    if not any(part in where for _, stack in accesses for _, where in stack for part in GRPC):
        return None
    if any(stack and stack[0][0].startswith(ALLOCATION) for _, stack in accesses):
        return HANDED_OVER_OBJECT
    return HANDED_OVER_MUTEX if creates_a_mutex(accesses) else None


def set_aside_by(block, build):
    """The rule that puts a report down to uninstrumented code, or None where the report is ours."""
    accesses = access_stacks(block)
    frames = [f for f in (first_frame(stack) for _, stack in accesses) if f is not None]
    if "ThreadSanitizer: data race" not in block or not frames:
        return None
    if any(any(t in f for t in THEIRS) or f.startswith(build) for f in frames):
        return THEIR_ACCESS
    return handed_over_by_grpc(accesses)


def digest(block, root):
    """One report in a line (CI's log may show no more of it than the count line): its kind, then each access as its
    heading's kind and the first frame of our code or the libraries' below the C++ library and the headers, or
    "stack lost"."""
    kind = re.search(r"ThreadSanitizer: ([^(\n]+)", block)[1].strip()
    parts = []
    for head, stack in access_stacks(block):
        where = next((f"{func} {spot.split()[0].removeprefix(root + '/')}" for func, spot in stack
                      if not any(part in spot for part in LIBRARY + ("/usr/include/",))), None)
        access = ACCESS.match(head)
        parts.append(f"{access['kind'] if access else head.strip().split(' in thread')[0]} in {where or 'stack lost'}")
    return f"{kind}: " + "; ".join(parts)


def main():
    root, build, paths = sys.argv[1], sys.argv[2], sys.argv[3:]
    ours, rules = [], collections.Counter()
    for path in paths:
        blocks = list(reports(path))
        for i, block in enumerate(blocks):
            rule = CUT_SHORT if cut_short(block, i == len(blocks) - 1) else set_aside_by(block, build)
            if rule:
                rules[rule] += 1
            else:
                ours.append(block)
    by_rule = ", ".join(f"{rules[rule]} {rule}"
                        for rule in (THEIR_ACCESS, HANDED_OVER_OBJECT, HANDED_OVER_MUTEX, CUT_SHORT))
    print(f"tsan reports: {len(ours)} ours, {sum(rules.values())} set aside ({by_rule})")
    for i, block in enumerate(ours):
        print(f"ours {i + 1}: {digest(block, root)}")
    for block in ours:
        print("==================\n" + block, end="")
    return 1 if ours else 0


if __name__ == "__main__":
    sys.exit(main())
