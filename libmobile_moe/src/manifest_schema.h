// Generated from mobile_moe/export/manifest_schema.py, the one manifest schema, by
//   python -m mobile_moe.export.manifest_schema --cpp-header > libmobile_moe/src/manifest_schema.h
// Do not edit: change the schema and regenerate (tests/test_docs.py compares the two).
#pragma once

#include <cstdint>

namespace mobile_moe::library {

inline constexpr const char* kManifestFile = "manifest.json";
inline constexpr const char* kFormat = "mobile-moe-bundle";
constexpr int64_t kVersion = 2;
inline constexpr const char* kTensorDtype = "float32";
constexpr int64_t kMaxManifestBytes = 67108864;
constexpr int64_t kMaxExperts = 4096;
constexpr int64_t kMaxDim = 65536;
constexpr int64_t kMaxElements = 268435456;
constexpr int64_t kMaxClasses = 1048576;
constexpr int64_t kMaxCount = 4611686018427387904;
constexpr int64_t kMaxGraphs = 65536;
constexpr int64_t kMaxName = 256;
constexpr int64_t kMaxPath = 4096;
constexpr int64_t kMaxLabel = 1024;
constexpr int64_t kMaxRank = 8;
constexpr int64_t kMaxTensors = 16;
constexpr int64_t kMaxBlock = 4096;
constexpr int64_t kMaxChannels = 4;

// How a bundle's graphs compose (composition.layout); kLayouts[i] is the manifest's word for Layout(i).
enum class Layout { Dense, Monolithic, ExpertPaths, PerBlock, Whole };
inline constexpr const char* kLayouts[] = {"dense", "monolithic", "expert-paths", "per-block", "whole"};
inline const char* name(Layout value) { return kLayouts[static_cast<int>(value)]; }

// What a runner does with a layout (Manifest.kind); kKinds[i] is the manifest's word for Kind(i).
enum class Kind { Split, Dense, Monolithic, Whole };
inline constexpr const char* kKinds[] = {"split", "dense", "monolithic", "whole"};
inline const char* name(Kind value) { return kKinds[static_cast<int>(value)]; }

// What a graph is (graphs[i].role); kRoles[i] is the manifest's word for Role(i).
enum class Role { Router, TrunkTail, Expert, BlockShared, BlockExpert, Head, Monolithic, Dense, Whole };
inline constexpr const char* kRoles[] = {"router", "trunk_tail", "expert", "block_shared", "block_expert", "head", "monolithic", "dense", "whole"};
inline const char* name(Role value) { return kRoles[static_cast<int>(value)]; }

// The runtime a bundle is for (backend); kBackends[i] is the manifest's word for Backend(i).
enum class Backend { Executorch, Onnx, Coreml };
inline constexpr const char* kBackends[] = {"executorch", "onnx", "coreml"};
inline const char* name(Backend value) { return kBackends[static_cast<int>(value)]; }

// How the model routes (routing); kRoutings[i] is the manifest's word for Routing(i).
enum class Routing { None, Image, Cluster, Token, Expert, Soft };
inline constexpr const char* kRoutings[] = {"none", "image", "cluster", "token", "expert", "soft"};
inline const char* name(Routing value) { return kRoutings[static_cast<int>(value)]; }

// How predict resizes an image (input.resize.policy); kResizePolicies[i] is the manifest's word for ResizePolicy(i).
enum class ResizePolicy { Stretch, ResizeCenterCrop };
inline constexpr const char* kResizePolicies[] = {"stretch", "resize-center-crop"};
inline const char* name(ResizePolicy value) { return kResizePolicies[static_cast<int>(value)]; }

// Where that policy came from (input.resize.origin); kResizeOrigins[i] is the manifest's word for ResizeOrigin(i).
enum class ResizeOrigin { Run, Assumed };
inline constexpr const char* kResizeOrigins[] = {"run", "assumed"};
inline const char* name(ResizeOrigin value) { return kResizeOrigins[static_cast<int>(value)]; }

// The resize's filter (input.resize.interpolation); kInterpolations[i] is the manifest's word for Interpolation(i).
enum class Interpolation { Bilinear, Bicubic };
inline constexpr const char* kInterpolations[] = {"bilinear", "bicubic"};
inline const char* name(Interpolation value) { return kInterpolations[static_cast<int>(value)]; }

// kKindOfLayout[layout]: Manifest.kind.
inline constexpr Kind kKindOfLayout[] = {Kind::Dense, Kind::Monolithic, Kind::Split, Kind::Split, Kind::Whole};
// kLayoutFitsRouting[routing][layout]: whether a model routing that way exports as that layout.
inline constexpr bool kLayoutFitsRouting[][5] = {{true, false, false, false, false}, {false, true, true, true, false}, {false, true, true, false, false}, {false, false, false, false, true}, {false, false, false, false, true}, {false, false, false, false, true}};

}  // namespace mobile_moe::library
