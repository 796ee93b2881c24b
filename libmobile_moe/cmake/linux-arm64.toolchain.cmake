# Cross-compiling the runner for linux-arm64 (aarch64, glibc) with Debian's g++-aarch64-linux-gnu, against the
# executorch manylinux aarch64 wheel unpacked (its executorch/ directory is CMAKE_PREFIX_PATH).
# mobile_moe/device_bench/arm64.py drives it (cached like the host build) and runs the result under qemu-user; by hand:
#
#   cmake -S libmobile_moe -B build-arm64 \
#     -DCMAKE_TOOLCHAIN_FILE=libmobile_moe/cmake/linux-arm64.toolchain.cmake \
#     -DCMAKE_PREFIX_PATH=$WHEEL/executorch -DCMAKE_SKIP_RPATH=ON && cmake --build build-arm64
#
# The same CMakeLists.txt builds the host and Android runners (build_android.sh uses the NDK's toolchain file). The
# runner links the wheel's shared libraries: a device needs them beside it (LD_LIBRARY_PATH), which the remote flow
# pushes; CMAKE_SKIP_RPATH keeps this machine's paths out of the binary.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
# Libraries and headers come from the aarch64 sysroot; programs (cmake's helpers) from this machine; the package
# config from CMAKE_PREFIX_PATH (the unpacked wheel) as well as the sysroot.
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)
