#!/usr/bin/env bash
# Cross-compile the native runner, libmobile_moe (the runtime as a library, mobile_moe.h) and its JNI part
# (libmobile_moe_jni.so, for org.mobilemoe.MobileMoe) for Android arm64 with the NDK's CMake toolchain, against an
# ExecuTorch Android install tree (the pip wheel is a host build and cannot be linked into an Android binary), then
# package the Java binding and both libraries as an AAR (java/package_aar.sh). Not run on this project's machines (no
# NDK there): the same CMakeLists.txt builds and tests all three on the host, and the tests package an AAR of the
# host's libraries with the same script.
#
#   ANDROID_NDK=/path/to/android-ndk-r27 EXECUTORCH_ANDROID=/path/to/executorch/cmake-out-android \
#     libmobile_moe/build_android.sh [OUT_DIR]
#
# Build ExecuTorch for Android first (from an executorch v1.5.1 checkout; the runner needs the module, data loader,
# tensor and threadpool extensions, the optimized kernels and the XNNPACK delegate):
#
#   cmake -S executorch -B cmake-out-android \
#     -DCMAKE_TOOLCHAIN_FILE=$ANDROID_NDK/build/cmake/android.toolchain.cmake \
#     -DANDROID_ABI=arm64-v8a -DANDROID_PLATFORM=android-26 -DCMAKE_BUILD_TYPE=Release \
#     -DCMAKE_INSTALL_PREFIX=cmake-out-android \
#     -DEXECUTORCH_BUILD_XNNPACK=ON -DEXECUTORCH_BUILD_KERNELS_OPTIMIZED=ON \
#     -DEXECUTORCH_BUILD_EXTENSION_MODULE=ON -DEXECUTORCH_BUILD_EXTENSION_DATA_LOADER=ON \
#     -DEXECUTORCH_BUILD_EXTENSION_FLAT_TENSOR=ON -DEXECUTORCH_BUILD_EXTENSION_NAMED_DATA_MAP=ON \
#     -DEXECUTORCH_BUILD_EXTENSION_TENSOR=ON -DEXECUTORCH_BUILD_EXTENSION_THREADPOOL=ON
#   cmake --build cmake-out-android -j8 --target install
#
# The same CMakeLists.txt builds the linux-arm64 runner with linux-arm64.toolchain.cmake against executorch's aarch64
# wheel; `make arm64` builds it and runs it here under qemu-user through the same flow as adb (--device arm64-emulated).
#
# Then run it through the toolkit (adb on PATH, phone with USB debugging):
#   mobile-moe bench BUNDLE --runtime native --device android[:SERIAL] --runner OUT_DIR/mobile_moe_runner
set -euo pipefail

: "${ANDROID_NDK:?set ANDROID_NDK to the Android NDK root (r26 or newer)}"
: "${EXECUTORCH_ANDROID:?set EXECUTORCH_ANDROID to an ExecuTorch Android install prefix (see the comment above)}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${1:-$HERE/build-android-arm64}"
ABI="${ANDROID_ABI:-arm64-v8a}"
PLATFORM="${ANDROID_PLATFORM:-android-26}"

cmake -S "$HERE" -B "$OUT" \
  -DCMAKE_TOOLCHAIN_FILE="$ANDROID_NDK/build/cmake/android.toolchain.cmake" \
  -DANDROID_ABI="$ABI" -DANDROID_PLATFORM="$PLATFORM" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$EXECUTORCH_ANDROID" \
  -DCMAKE_FIND_ROOT_PATH="$EXECUTORCH_ANDROID" \
  -DCMAKE_FIND_ROOT_PATH_MODE_PACKAGE=BOTH
cmake --build "$OUT" --parallel
echo "built $OUT/mobile_moe_runner (static, $ABI); run it with --device android --runner $OUT/mobile_moe_runner"
"$HERE/java/package_aar.sh" "$OUT/mobile-moe.aar" "$ABI" "$OUT"
echo "built $OUT/mobile-moe.aar (classes.jar, jni/$ABI/libmobile_moe.so and libmobile_moe_jni.so): an app's"
echo "  build.gradle takes it as implementation files('libs/mobile-moe.aar')"
