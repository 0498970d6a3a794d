#!/usr/bin/env python3
"""`./dev tsan` end to end on a race of ours on a mutex's lifetime: mutex_freed_under_lock under the preloaded
annotations, its reports classified. Both of the mutex's accesses are the annotations', so the report is ours only if
the annotations push their caller's frame and the classifier passes over theirs.

Usage: caught_race_test.py PROGRAM ANNOTATIONS_LIBRARY REPO_ROOT BUILD_DIR
"""
import glob
import os
import subprocess
import sys
import tempfile
import unittest

PROGRAM, ANNOTATIONS, ROOT, BUILD = sys.argv[1:5]
HERE = os.path.dirname(os.path.abspath(__file__))


class CaughtRaceTest(unittest.TestCase):
    def test_a_mutex_of_ours_freed_after_another_threads_unlock_is_ours(self):
        with tempfile.TemporaryDirectory() as folder:
            env = dict(os.environ, LD_PRELOAD=ANNOTATIONS, TSAN_OPTIONS=f"log_path={folder}/report exitcode=0")
            subprocess.run([PROGRAM], env=env, check=True, timeout=60)
            reports = glob.glob(f"{folder}/report*")
            self.assertTrue(reports, "ThreadSanitizer reported nothing")
            result = subprocess.run([sys.executable, os.path.join(HERE, "classify_reports.py"), ROOT, BUILD, *reports],
                                    capture_output=True, text=True)
        self.assertEqual(result.returncode, 1, result.stdout)
        # The frames that unlocked and destroyed the mutex, which the annotations' own frames hid.
        self.assertIn("LockOnce", result.stdout)
        self.assertRegex(result.stdout, r"Mutex::~Mutex\(\) .*\n +#\d+ main ")


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1])
