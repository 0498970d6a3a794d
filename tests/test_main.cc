// The test programs' main: GoogleTest's, with argv[0] made absolute. The threadsafe death tests re-execute the
// program with execv(argv[0]), which fails where it was started through PATH (the CUDA host's bundle `env`).
#include <gtest/gtest.h>

int main(int argc, char** argv) {
  char self[] = "/proc/self/exe";
  argv[0] = self;
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
