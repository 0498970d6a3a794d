#!/usr/bin/env python3
"""classify_reports.py on reports as ThreadSanitizer writes them: races between this project's accesses, lock-order
inversions and mutex misuse are ours; a race with an access by gRPC's, protobuf's or abseil's code is not."""
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = "/src/perception"
BUILD = "/src/perception/build-tsan"

OUR_RACE = """==================
WARNING: ThreadSanitizer: data race (pid=2744)
  Write of size 8 at 0x7b1400005050 by thread T5:
    #0 std::deque<int>::pop_front() /usr/include/c++/12/bits/stl_deque.h:1582 (handoff_tests+0x1)
    #1 StreamBatcher::AddPendingLocked(long) /src/perception/server/stream_batcher.cc:605 (handoff_tests+0x2)

  Previous read of size 8 at 0x7b1400005050 by thread T1:
    #0 StreamBatcher::RoomToRead(bool) /src/perception/server/stream_batcher.cc:599 (handoff_tests+0x3)

  Thread T5 (tid=2762, running) created by main thread at:
    #0 pthread_create ../../../../src/libsanitizer/tsan/tsan_interceptors_posix.cpp:1001 (libtsan.so.2+0x5e686)

SUMMARY: ThreadSanitizer: data race /src/perception/server/stream_batcher.cc:605 in AddPendingLocked(long)
==================
"""

GRPC_RACE = """==================
WARNING: ThreadSanitizer: data race (pid=1824)
  Read of size 8 at 0x7b7400020438 by thread T8:
    #0 CallOpRecvMessage<StreamRequest>::FinishOp(bool*) /usr/include/grpcpp/impl/call_op_set.h:446 (handoff_tests+0x9)

  Previous write of size 8 at 0x7b7400020438 by thread T9:
    #0 memcpy ../../../../src/libsanitizer/sanitizer_common/interceptors.inc:827 (libtsan.so.2+0x5dda6)
    #1 perception::server::StreamReactor::OnReadDone(bool) /src/perception/server/streaming.cc:70 (handoff_tests+0x4)

SUMMARY: ThreadSanitizer: data race /usr/include/grpcpp/impl/call_op_set.h:446 in FinishOp(bool*)
==================
WARNING: ThreadSanitizer: data race (pid=2780)
  Write of size 8 at 0x7b640000ff08 by main thread:
    #0 free ../../../../src/libsanitizer/tsan/tsan_interceptors_posix.cpp:706 (libtsan.so.2+0x47e82)
    #1 grpc_slice_buffer_destroy <null> (libgrpc.so.29+0x4d4a7e)
    #2 Run /src/perception/client/perceptionctl_main.cc:366 (perceptionctl+0x292c2)

  Previous read of size 1 at 0x7b640000ff0a by thread T1:
    #0 sendmsg ../../../../src/libsanitizer/sanitizer_common/interceptors.inc:3160 (libtsan.so.2+0x55518)
    #1 tcp_send(int, msghdr const*, int*, int) <null> (libgrpc.so.29+0x4225c1)

SUMMARY: ThreadSanitizer: data race (/lib/x86_64-linux-gnu/libgrpc.so.29+0x4d4a7e) in grpc_slice_buffer_destroy
==================
WARNING: ThreadSanitizer: data race (pid=2781)
  Write of size 8 at 0x7b640000ff08 by thread T2:
    #0 StreamRequest::Clear() /src/perception/build-tsan/proto/perception/v1/perception.pb.cc:10404 (e2e_tests+0x5)

  Previous read of size 8 at 0x7b640000ff08 by thread T1:
    #0 perception::server::StreamReactor::OnReadDone(bool) /src/perception/server/streaming.cc:70 (e2e_tests+0x6)

SUMMARY: ThreadSanitizer: data race /src/perception/build-tsan/proto/perception/v1/perception.pb.cc:10404 in Clear()
==================
"""

INVERSION = """==================
WARNING: ThreadSanitizer: lock-order-inversion (potential deadlock) (pid=1824)
  Cycle in lock order graph: M0 (0x7b7000000220) => M1 (0x7b7000000300) => M0

  Mutex M1 acquired here while holding mutex M0 in thread T1:
    #0 absl::Mutex::Lock() /src/perception/tests/tsan/absl_mutex_annotations.cc:140 (libabsl_tsan_annotations.so+0x1)
    #1 StreamBatcher::Tick(ModelHost&) /src/perception/server/stream_batcher.cc:290 (handoff_tests+0x7)

  Mutex M0 acquired here while holding mutex M1 in thread T2:
    #0 absl::Mutex::Lock() /src/perception/tests/tsan/absl_mutex_annotations.cc:140 (libabsl_tsan_annotations.so+0x1)
    #1 perception::server::StreamReactor::OnProcessed() /src/perception/server/streaming.cc:90 (handoff_tests+0x8)

SUMMARY: ThreadSanitizer: lock-order-inversion (potential deadlock) /src/perception/server/stream_batcher.cc:290 in Tick
==================
"""

# A mutex of ours destroyed while another thread still unlocks it: both accesses are the preloaded annotations' (the
# shape of a real report, from a Holder freed under a MutexLock on another thread).
OUR_MUTEX_FREED_UNDER_ITS_LOCK = """==================
WARNING: ThreadSanitizer: data race (pid=2078)
  Write of size 1 at 0x7b0400000000 by main thread:
    #0 __tsan_mutex_destroy ../../../../src/libsanitizer/tsan/tsan_interface_ann.cpp:358 (libtsan.so.2+0x70bf1)
    #1 absl::Mutex::~Mutex() /src/perception/tests/tsan/absl_mutex_annotations.cc:163 (libabsl_tsan_annotations.so+0x1)
    #2 perception::server::StreamReactor::~StreamReactor() /src/perception/server/streaming.cc:40 (e2e_tests+0x24eb)

  Previous atomic read of size 1 at 0x7b0400000000 by thread T1 (mutexes: write M3512956830613504):
    #0 __tsan_mutex_pre_unlock ../../../../src/libsanitizer/tsan/tsan_interface_ann.cpp:390 (libtsan.so.2+0x710d4)
    #1 Releasing /src/perception/tests/tsan/absl_mutex_annotations.cc:48 (libabsl_tsan_annotations.so+0x1)
    #2 absl::Mutex::Unlock() /src/perception/tests/tsan/absl_mutex_annotations.cc:202 (libabsl_tsan_annotations.so+0x1)
    #3 absl::MutexLock::~MutexLock() /usr/include/absl/synchronization/mutex.h:550 (e2e_tests+0x2313)
    #4 perception::server::StreamReactor::OnCancel() /src/perception/server/streaming.cc:95 (e2e_tests+0x2313)

SUMMARY: ThreadSanitizer: data race /src/perception/tests/tsan/absl_mutex_annotations.cc:163 in ~Mutex()
==================
"""

# The same race on a mutex of gRPC's, locked through the annotations by its core.
GRPC_MUTEX_FREED_UNDER_ITS_LOCK = """==================
WARNING: ThreadSanitizer: data race (pid=2079)
  Write of size 8 at 0x7b0400000040 by thread T3:
    #0 free ../../../../src/libsanitizer/tsan/tsan_interceptors_posix.cpp:706 (libtsan.so.2+0x47e82)
    #1 grpc_call_unref <null> (libgrpc.so.29+0x1a2b3c)

  Previous atomic read of size 1 at 0x7b0400000040 by thread T1:
    #0 __tsan_mutex_pre_lock ../../../../src/libsanitizer/tsan/tsan_interface_ann.cpp:366 (libtsan.so.2+0x70c41)
    #1 Acquired /src/perception/tests/tsan/absl_mutex_annotations.cc:43 (libabsl_tsan_annotations.so+0x1)
    #2 absl::Mutex::Lock() /src/perception/tests/tsan/absl_mutex_annotations.cc:168 (libabsl_tsan_annotations.so+0x1)
    #3 grpc_core::Server::CallData::Start <null> (libgrpc.so.29+0x3c4d5e)

SUMMARY: ThreadSanitizer: data race (/lib/x86_64-linux-gnu/libgrpc.so.29+0x1a2b3c) in grpc_call_unref
==================
"""


# A reactor allocated on the thread gRPC created it on, its mutex first locked on the thread gRPC called it back on
# (the shape of a real report): gRPC handed it over.
REACTOR_HANDED_OVER_BY_GRPC = """==================
WARNING: ThreadSanitizer: data race (pid=27915)
  Atomic read of size 1 at 0x7b50000c06d0 by thread T9:
    #0 __tsan_mutex_post_lock ../../../../src/libsanitizer/tsan/tsan_interface_ann.cpp:377 (libtsan.so.2+0x70f08)
    #1 Acquired /src/perception/tests/tsan/absl_mutex_annotations.cc:44 (libabsl_tsan_annotations.so+0x1)
    #2 absl::MutexLock::MutexLock(absl::Mutex*) /usr/include/absl/synchronization/mutex.h:533 (perceptiond+0x1)
    #3 StreamReactor::OnWriteDone(bool) /src/perception/server/streaming.cc:116 (perceptiond+0x2)
    #4 CallbackWithSuccessTag::Run(bool) /usr/include/grpcpp/support/callback_common.h:212 (perceptiond+0x3)

  Previous write of size 8 at 0x7b50000c06d0 by thread T10:
    #0 operator new(unsigned long) ../../../../src/libsanitizer/tsan/tsan_new_delete.cpp:64 (libtsan.so.2+0x87323)
    #1 PerceptionService::Stream(Context*) /src/perception/server/perception_service.cc:275 (perceptiond+0x4)

SUMMARY: ThreadSanitizer: data race /src/perception/tests/tsan/absl_mutex_annotations.cc:44 in Acquired
==================
"""

# The same allocation and access with no call of gRPC's on the way: ours.
OUR_OBJECT_PASSED_WITHOUT_ORDER = """==================
WARNING: ThreadSanitizer: data race (pid=27916)
  Read of size 8 at 0x7b50000c06d0 by thread T2:
    #0 perception::server::DeviceWorker::Loop() /src/perception/server/device_worker.cc:90 (perceptiond+0x5)

  Previous write of size 8 at 0x7b50000c06d0 by thread T1:
    #0 operator new(unsigned long) ../../../../src/libsanitizer/tsan/tsan_new_delete.cpp:64 (libtsan.so.2+0x87323)
    #1 perception::server::DeviceWorker::Run() /src/perception/server/device_worker.cc:60 (perceptiond+0x6)

SUMMARY: ThreadSanitizer: data race /src/perception/server/device_worker.cc:90 in Loop()
==================
"""


# The same handover where TSan lost the stack of the write that created the mutex (the shape of the report that failed
# CI at caf9cec): a plain 8-byte write to a mutex's word can only be its allocation or constructor.
MUTEX_CREATION_WITH_A_LOST_STACK = """==================
WARNING: ThreadSanitizer: data race (pid=13983)
  Atomic read of size 1 at 0x7b5000011ad0 by thread T10:
    #0 __tsan_mutex_post_lock ../../../../src/libsanitizer/tsan/tsan_interface_ann.cpp:377 (libtsan.so.2+0x70f08)
    #1 Acquired /src/perception/tests/tsan/absl_mutex_annotations.cc:44 (libabsl_tsan_annotations.so+0x316a)
    #2 absl::MutexLock::MutexLock(absl::Mutex*) /usr/include/absl/synchronization/mutex.h:533 (perceptiond+0xe1e66)
    #3 perception::server::StreamReactor::OnReadDone(bool) /src/perception/server/streaming.cc:53 (perceptiond+0xe27b7)
    #4 CallbackWithSuccessTag::Run(bool) /usr/include/grpcpp/support/callback_common.h:212 (perceptiond+0xa13d2)

  Previous write of size 8 at 0x7b5000011ad0 by thread T9:
    [failed to restore the stack]

  Location is heap block of size 512 at 0x7b5000011a00 allocated by thread T9:
    #0 operator new(unsigned long) ../../../../src/libsanitizer/tsan/tsan_new_delete.cpp:64 (libtsan.so.2+0x87323)
    #1 PerceptionService::Stream(Context*) /src/perception/server/perception_service.cc:275 (perceptiond+0x92676)

SUMMARY: ThreadSanitizer: data race /src/perception/tests/tsan/absl_mutex_annotations.cc:44 in Acquired
==================
"""

# The same handover where the annotations recorded the mutex's creation, a 1-byte write by `__tsan_mutex_create` in
# its constructor (the report, shortened, that failed a local CI run at 745be71): gRPC's. Without gRPC's callback on
# the way: ours.
MUTEX_CREATION_RECORDED_BY_THE_ANNOTATIONS = """==================
WARNING: ThreadSanitizer: data race (pid=23274)
  Atomic read of size 1 at 0x7b50000594d0 by thread T10:
    #0 __tsan_mutex_post_lock ../../../../src/libsanitizer/tsan/tsan_interface_ann.cpp:377 (libtsan.so.2+0x70f08)
    #1 Acquired /src/perception/tests/tsan/absl_mutex_annotations.cc:44 (libabsl_tsan_annotations.so+0x316a)
    #2 absl::MutexLock::MutexLock(absl::Mutex*) /usr/include/absl/synchronization/mutex.h:533 (perceptiond+0xe2fe6)
    #3 perception::server::StreamReactor::OnReadDone(bool) /src/perception/server/streaming.cc:53 (perceptiond+0xe3937)
    #4 CallbackWithSuccessTag::Run(bool) /usr/include/grpcpp/support/callback_common.h:212 (perceptiond+0xa23f2)

  Previous write of size 1 at 0x7b50000594d0 by thread T9:
    #0 __tsan_mutex_create ../../../../src/libsanitizer/tsan/tsan_interface_ann.cpp:352 (libtsan.so.2+0x70a80)
    #1 absl::Mutex::Mutex() /usr/include/absl/synchronization/mutex.h:942 (perceptiond+0xe78d9)
    #2 perception::server::StreamReactor::StreamReactor() /src/perception/server/streaming.cc:40 (perceptiond+0xe78d9)
    #3 perception::server::PerceptionService::Stream(Context*) /src/perception/server/perception_service.cc:275 (perceptiond+0x93715)

  Location is heap block of size 512 at 0x7b5000059400 allocated by thread T9:
    #0 operator new(unsigned long) ../../../../src/libsanitizer/tsan/tsan_new_delete.cpp:64 (libtsan.so.2+0x87323)
    #1 PerceptionService::Stream(Context*) /src/perception/server/perception_service.cc:275 (perceptiond+0x93696)

SUMMARY: ThreadSanitizer: data race /src/perception/tests/tsan/absl_mutex_annotations.cc:44 in Acquired
==================
"""
OUR_MUTEX_CREATION_RECORDED_BY_THE_ANNOTATIONS = MUTEX_CREATION_RECORDED_BY_THE_ANNOTATIONS.replace(
    "    #4 CallbackWithSuccessTag::Run(bool) /usr/include/grpcpp/support/callback_common.h:212 (perceptiond+0xa23f2)\n",
    "")

# A lost write beside a mutex's lock, outside gRPC, or of another size or address than a mutex's creation: ours.
OUR_LOST_WRITES_BESIDE_A_LOCK = [
    MUTEX_CREATION_WITH_A_LOST_STACK.replace("    #4 CallbackWithSuccessTag::Run(bool) /usr/include/grpcpp/support/"
                                             "callback_common.h:212 (perceptiond+0xa13d2)\n", ""),
    MUTEX_CREATION_WITH_A_LOST_STACK.replace("Previous write of size 8", "Previous write of size 4"),
    MUTEX_CREATION_WITH_A_LOST_STACK.replace("Previous write of size 8 at 0x7b5000011ad0",
                                             "Previous write of size 8 at 0x7b5000011ad8"),
    MUTEX_CREATION_WITH_A_LOST_STACK.replace("Previous write of size 8", "Previous read of size 8"),
]


# A message's bytes copied by upb, the protobuf runtime gRPC's core parses with (libupb.so.29 from Debian's libgrpc29),
# against a write whose stack TSan lost (the report that failed a local CI run at f253a82): gRPC's.
MESSAGE_COPIED_BY_UPB = """==================
WARNING: ThreadSanitizer: data race (pid=1370)
  Read of size 8 at 0x7b0c00006df0 by thread T3:
    #0 memcpy ../../../../src/libsanitizer/sanitizer_common/sanitizer_common_interceptors.inc:827 (libtsan.so.2+0x5dda6)
    #1 memcpy ../../../../src/libsanitizer/sanitizer_common/sanitizer_common_interceptors.inc:819 (libtsan.so.2+0x5dda6)
    #2 <null> <null> (libupb.so.29+0x12db1)

  Previous write of size 8 at 0x7b0c00006df0 by thread T10:
    [failed to restore the stack]

  Location is heap block of size 40 at 0x7b0c00006de0 allocated by thread T10:
    #0 operator new(unsigned long) ../../../../src/libsanitizer/tsan/tsan_new_delete.cpp:64 (libtsan.so.2+0x87323)
    #1 <null> <null> (libabsl_cord.so.20220623+0x63e9)

SUMMARY: ThreadSanitizer: data race (/lib/x86_64-linux-gnu/libupb.so.29+0x12db1)
==================
"""

# The last report of a daemon killed while TSan wrote it (CI, the fifty-fourth session): nothing past its first line.
CUT_OFF = """==================
WARNING: ThreadSanitizer: data race (pid=12153)
  Write of size 8 at 0x7b740000fbc0 by thread T9:
"""

# The last report of a daemon killed while TSan wrote it (CI at a5b2db6): its one frame the interceptor of gRPC's send.
CUT_OFF_IN_THE_INTERCEPTOR = """==================
WARNING: ThreadSanitizer: data race (pid=12364)
  Read of size 8 at 0x7b44000102d0 by thread T14:
    #0 sendmsg ../../../../src/libsanitizer/sanitizer_common/sanitizer_common_interceptors.inc:3160 (libtsan.so.2+0x55518)
"""


def classify(*texts):
    with tempfile.TemporaryDirectory() as folder:
        paths = []
        for i, text in enumerate(texts):
            paths.append(os.path.join(folder, f"report.{i}"))
            with open(paths[-1], "w") as f:
                f.write(text)
        return subprocess.run([sys.executable, os.path.join(HERE, "classify_reports.py"), ROOT, BUILD, *paths],
                              capture_output=True, text=True)


class ClassifyReportsTest(unittest.TestCase):
    def assertClassified(self, *reports, ours, theirs):
        """The reports classified: the exit status fails on any of ours, the count line says how many of each. Returns
        what the classifier printed."""
        result = classify(*reports)
        self.assertEqual(result.returncode, 1 if ours else 0, result.stdout)
        self.assertIn(f"tsan reports: {ours} ours, {theirs} set aside (", result.stdout)
        return result.stdout

    def test_a_race_between_our_accesses_is_ours(self):
        self.assertIn("stream_batcher.cc:605", self.assertClassified(OUR_RACE, ours=1, theirs=0))

    def test_races_with_an_access_by_grpc_or_generated_protobuf_code_are_not(self):
        self.assertClassified(GRPC_RACE, ours=0, theirs=3)

    def test_a_race_with_a_copy_made_by_grpcs_upb_is_grpcs(self):
        self.assertClassified(MESSAGE_COPIED_BY_UPB, ours=0, theirs=1)

    def test_a_lock_order_inversion_is_ours_whatever_its_frames(self):
        self.assertIn("lock-order-inversion", self.assertClassified(GRPC_RACE, INVERSION, ours=1, theirs=3))

    def test_a_mutex_of_ours_freed_under_its_lock_is_ours_though_the_annotations_made_both_accesses(self):
        self.assertIn("StreamReactor::OnCancel()",
                      self.assertClassified(OUR_MUTEX_FREED_UNDER_ITS_LOCK, ours=1, theirs=0))

    def test_a_mutex_of_grpcs_locked_through_the_annotations_is_grpcs(self):
        self.assertClassified(GRPC_MUTEX_FREED_UNDER_ITS_LOCK, ours=0, theirs=1)

    def test_an_allocation_against_an_access_in_a_grpc_callback_is_grpcs_handover(self):
        self.assertClassified(REACTOR_HANDED_OVER_BY_GRPC, ours=0, theirs=1)

    def test_an_allocation_against_an_access_of_ours_outside_grpc_is_ours(self):
        self.assertClassified(OUR_OBJECT_PASSED_WITHOUT_ORDER, ours=1, theirs=0)

    def test_a_mutex_created_with_a_lost_stack_against_its_lock_in_a_grpc_callback_is_grpcs_handover(self):
        self.assertClassified(MUTEX_CREATION_WITH_A_LOST_STACK, ours=0, theirs=1)

    def test_a_mutex_creation_the_annotations_recorded_against_its_lock_in_a_grpc_callback_is_grpcs_handover(self):
        self.assertIn("1 between a mutex's creation and a call gRPC made",
                      self.assertClassified(MUTEX_CREATION_RECORDED_BY_THE_ANNOTATIONS, ours=0, theirs=1))

    def test_a_mutex_creation_the_annotations_recorded_against_its_lock_outside_grpc_is_ours(self):
        self.assertIn("StreamReactor::OnReadDone(bool)",
                      self.assertClassified(OUR_MUTEX_CREATION_RECORDED_BY_THE_ANNOTATIONS, ours=1, theirs=0))

    def test_the_reports_set_aside_are_counted_by_the_rule_that_set_them_aside(self):
        output = self.assertClassified(GRPC_RACE, REACTOR_HANDED_OVER_BY_GRPC, MUTEX_CREATION_WITH_A_LOST_STACK,
                                       MESSAGE_COPIED_BY_UPB, ours=0, theirs=6)
        self.assertIn("6 set aside (4 with an access made by uninstrumented gRPC, protobuf or abseil code, 1 between "
                      "an object's allocation and a call gRPC made, 1 between a mutex's creation and a call gRPC "
                      "made, 0 cut off before naming any code as their process ended)", output)

    def test_each_of_ours_is_told_in_one_line_after_the_count(self):
        lines = self.assertClassified(OUR_LOST_WRITES_BESIDE_A_LOCK[0], INVERSION, ours=2, theirs=0).splitlines()
        self.assertEqual(lines[1], "ours 1: data race: Atomic read in perception::server::StreamReactor::"
                                   "OnReadDone(bool) server/streaming.cc:53; Previous write in stack lost")
        self.assertEqual(lines[2], "ours 2: lock-order-inversion: Mutex M1 acquired here while holding mutex M0 in "
                                   "StreamBatcher::Tick(ModelHost&) server/stream_batcher.cc:290; Mutex M0 acquired "
                                   "here while holding mutex M1 in perception::server::StreamReactor::OnProcessed() "
                                   "server/streaming.cc:90")

    def test_a_race_cut_off_before_naming_any_code_at_the_end_of_its_file_is_set_aside(self):
        for cut_off in (CUT_OFF, CUT_OFF_IN_THE_INTERCEPTOR):
            with self.subTest(report=cut_off):
                self.assertIn("1 cut off before naming any code as their process ended",
                              self.assertClassified(GRPC_RACE + cut_off, ours=0, theirs=4))

    def test_a_race_naming_no_code_before_another_report_or_one_cut_off_after_a_frame_of_code_is_ours(self):
        self.assertClassified(CUT_OFF + OUR_RACE, ours=2, theirs=0)
        self.assertClassified(CUT_OFF_IN_THE_INTERCEPTOR + OUR_RACE, ours=2, theirs=0)
        self.assertClassified(OUR_RACE.removesuffix("==================\n").split("\n  Previous")[0] + "\n",
                              ours=1, theirs=0)

    def test_a_lost_write_that_cannot_be_a_mutex_creation_in_grpcs_hands_is_ours(self):
        for report in OUR_LOST_WRITES_BESIDE_A_LOCK:
            with self.subTest(report=report):
                self.assertIn("StreamReactor::OnReadDone(bool)", self.assertClassified(report, ours=1, theirs=0))


if __name__ == "__main__":
    unittest.main()
