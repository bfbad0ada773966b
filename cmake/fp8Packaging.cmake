# Debian packages of the installed tree, made by `cpack -G DEB` in the build directory from the two
# install components of CMakeLists.txt:
#   libfp8      (component runtime)  libfp8.so.<major> and libfp8.so.<version>
#   libfp8-dev  (component dev)      fp8.h, the libfp8.so link, libfp8.a (FP8_BUILD_STATIC), fp8.pc
#                                    and the CMake package; it depends on libfp8 of the same version
# They install under /usr (CPACK_PACKAGING_INSTALL_PREFIX) with the library directory this build
# was configured with (CMAKE_INSTALL_LIBDIR: lib/x86_64-linux-gnu when CMAKE_INSTALL_PREFIX is
# /usr, else lib). The CUDA runtime, cuBLASLt and NCCL come from the CUDA toolkit in
# /usr/local/cuda, not from Debian packages, so no Depends can name them; the description does.
# The test deb_packages builds both, unpacks them and builds the consumers against them.
set(FP8_PACKAGE_MAINTAINER "libfp8 maintainers <maintainers@users.noreply.a-seed-2173ffb9.example>"
  CACHE STRING "Maintainer field of the Debian packages (cpack -G DEB)")

set(CPACK_PACKAGE_NAME libfp8)
set(CPACK_PACKAGE_VENDOR "libfp8")
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
# Empty on purpose: CPackDeb would put this summary first in both packages' descriptions; each
# package's synopsis is instead the first line of its component's description below.
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "")
set(CPACK_PACKAGE_CONTACT "${FP8_PACKAGE_MAINTAINER}")
set(CPACK_DEBIAN_PACKAGE_MAINTAINER "${FP8_PACKAGE_MAINTAINER}")
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)

# One package per component; file names <package>_<version>_<architecture>.deb. (Debian's own
# policy would call the runtime package after the SONAME, libfp8-0: set
# CPACK_DEBIAN_RUNTIME_PACKAGE_NAME and the test deb_packages' expectation together to change it.)
set(CPACK_DEB_COMPONENT_INSTALL ON)
set(CPACK_COMPONENTS_ALL runtime dev)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_RUNTIME_PACKAGE_NAME libfp8)
set(CPACK_DEBIAN_DEV_PACKAGE_NAME libfp8-dev)
set(CPACK_DEBIAN_RUNTIME_PACKAGE_SECTION libs)
set(CPACK_DEBIAN_DEV_PACKAGE_SECTION libdevel)

# libfp8-dev: Depends: libfp8 (= <version>), from the component dependency.
set(CPACK_COMPONENT_DEV_DEPENDS runtime)
set(CPACK_DEBIAN_ENABLE_COMPONENT_DEPENDS ON)
# libfp8: Depends on the Debian libraries it links (libc6, libstdc++6, libgcc-s1, zlib1g) with the
# versions dpkg-shlibdeps (Debian's dpkg-dev) finds; without it, on those libraries unversioned.
# The CUDA libraries, in a private directory, are left to the description. A shlibs file lets
# packages built against libfp8 depend on it in turn: any libfp8 of this major version at least
# as new as the one they were built with.
find_program(FP8_DPKG_SHLIBDEPS dpkg-shlibdeps)
mark_as_advanced(FP8_DPKG_SHLIBDEPS)
if(FP8_DPKG_SHLIBDEPS)
  set(CPACK_DEBIAN_RUNTIME_PACKAGE_SHLIBDEPS ON)
  set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS_PRIVATE_DIRS "${CUDAToolkit_LIBRARY_DIR};${FP8_NCCL_LIBDIR}")
else()
  set(CPACK_DEBIAN_RUNTIME_PACKAGE_DEPENDS "libc6, libgcc-s1, libstdc++6, zlib1g")
endif()
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS ON)
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS_POLICY ">=")

set(CPACK_COMPONENT_RUNTIME_DESCRIPTION "${PROJECT_DESCRIPTION} - shared library
libfp8 runs FP8 mixed-precision training (FP8 Linear and LayerNorm layers with
delayed scaling, an FP8-aware Adam at the MS-AMP optimisation levels O1 to O3, FP8
gradient exchange over NCCL, checkpoints) behind a stable C ABI, with a CPU
reference backend for machines without a GPU.
This package holds the shared library, libfp8.so.${PROJECT_VERSION_MAJOR}.
It needs the CUDA ${CUDAToolkit_VERSION_MAJOR} runtime, cuBLASLt and NCCL 2 of the CUDA toolkit,
which are not Debian packages; it looks for them in ${CUDAToolkit_LIBRARY_DIR}.")
set(CPACK_COMPONENT_DEV_DESCRIPTION "${PROJECT_DESCRIPTION} - development files
The C header fp8.h, the libfp8.so link, the static library libfp8.a where it was
built, the pkg-config file fp8.pc and the CMake package fp8 (find_package(fp8):
targets fp8::fp8 and fp8::fp8_static), to build programs against libfp8.")

include(CPack)
