# aarch64-linux-gnu.cmake — cross-compiling heads for 64-bit ARM Linux on an x86-64 Debian host
# (scripts/test-aarch64.sh): the GNU cross compiler (g++-aarch64-linux-gnu), the arm64 libraries of
# Debian's multiarch (libdnnl-dev:arm64, ...), and qemu-user running the test programs.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)
set(ENV{PKG_CONFIG_LIBDIR} /usr/lib/aarch64-linux-gnu/pkgconfig:/usr/share/pkgconfig)
# Test programs run through qemu (ctest, gtest_discover_tests): `-cpu max` offers every extension
# QEMU implements (NEON, dotprod, bf16, i8mm, SVE). The arm64 libraries are found where Debian's
# multiarch puts them (with `-L /usr/aarch64-linux-gnu`, the cross toolchain's own copies, a
# program's second thread never starts under QEMU 7.2).
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64;-cpu;max)
