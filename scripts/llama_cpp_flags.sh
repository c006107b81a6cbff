# Sourced by build_llama_cpp_python.sh and build_llama_server.sh: one llama.cpp source and one
# set of build flags for both, so the in-process back end and llama-server are the same code.
#
# The source is the llama.cpp that the llama-cpp-python sdist vendors (pinned below). CPU
# flags: GGML_NATIVE=OFF with ggml's default instruction sets for that case (SSE4.2, AVX, AVX2,
# BMI2, FMA, F16C; no AVX-512, no AMX): a build that runs on any x86-64 machine of the last
# decade. (A native build on an AMX machine repacks Q4 weights for AMX and crashed in
# llama_decode here.) For CUDA, set LLAMA_CMAKE_EXTRA="-DGGML_CUDA=on".
LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
LLAMA_CMAKE_FLAGS="-DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF ${LLAMA_CMAKE_EXTRA:-}"
LLAMA_FLAGS_TAG="$(printf '%s' "$LLAMA_CMAKE_FLAGS" | sha1sum | cut -c1-8)"
