// A bundle's manifest.json: struct Spec / Graph / Bundle, validate() against the schema's rules (built on the value
// checks of manifest_values.h), verify_graph_files() (size + sha256) and read_bundle(), which does all three.
// Part of libmobile_moe; bundle_manifest.cpp is the parser, the one C++ file that reads the manifest's words.
//
// The manifest is untrusted input (a bundle can be copied to a phone by hand, where no Python validated it), so the
// runner enforces the rules of the one manifest schema (mobile_moe/export/manifest_schema.py) itself: every value it
// uses is type- and range-checked (integers exact: 1.5, 1e300, -3, true and "4" are refused), the layout's cross-field
// rules hold (what an image touches included: routing kind against layout, params_active_max against the graphs'
// params), every graph file matches its size and sha256 before any graph is loaded, and each loaded program's method
// signature matches the graph's specs before it runs. Every violation is a UsageError (exit 2), never a crash.
#pragma once

#include <cstddef>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "file_identity.h"
#include "manifest_schema.h"
#include "preprocess.h"

namespace mobile_moe::json {
struct Value;
}  // namespace mobile_moe::json

namespace mobile_moe::library {

struct Spec {
  std::string name;
  std::vector<int32_t> shape;
  int64_t numel = 1;
};

// A file the manifest names: relative to the bundle, resolved inside it, with its recorded size and sha256.
struct File {
  std::string file, path, sha256;
  int64_t bytes = 0;  // the manifest's size, checked against the file
  FileIdentity verified;  // the file as it was when its size, sha256 and structure were checked (at open)
};

struct Graph {
  std::string name, role;
  int expert = -1;
  // An expert's graph: loaded and evicted as routing changes (mapped whole, its packed weights copied in large
  // writes, parked when evicted), where the other graphs are loaded once per process.
  bool switched() const { return expert >= 0; }
  int64_t params = 0;  // weights the graph carries (parameters and buffers)
  File program;        // the ExecuTorch program (.pte)
  // ExecuTorch named data (.ptd) with the weights this graph keeps outside its program, when graphs share one
  // program (mobile_moe/export/executorch_family.py); empty `file` when the program holds them all.
  File weights;
  bool shares_program() const { return !weights.file.empty(); }
  int64_t load_bytes() const { return program.bytes + weights.bytes; }  // what loading the graph reads
  std::vector<Spec> inputs, outputs;
  std::vector<std::vector<int32_t>> input_shapes;
  // Index of the named output ("logits", "tokens", "router_probs", "expert_tokens") among the outputs; -1 when absent.
  int output(const std::string& wanted) const;
};

// The manifest's composition, resolved to files. Layouts (mobile_moe/export/graphs.py):
//   expert-paths (k = 1): router; expert e = one graph (tokens, gate) -> logits; with early routing a trunk tail
//                         (tokens -> tokens) runs between them, while the chosen expert loads
//   per-block (any k):    router, per MoE block a shared graph (tokens -> residual, normed), head (tokens -> logits)
//                         loaded at open; expert e = one MLP graph per block (normed -> delta), x = residual + g * delta
//   dense / monolithic:   one graph, images -> logits (+ router_probs)
//   whole:                one graph, images -> logits, expert_tokens (1, G, E) (a per-token MoE, every expert
//                         inside; G expert sets, one per MoE block that owns its experts)
struct Bundle {
  std::string dir;     // real path
  Kind kind = Kind::Dense;  // Split (router + experts), Dense, Monolithic, Whole
  Layout layout = Layout::Dense;
  int num_experts = 0, top_k = 1;
  bool renormalize_gates = false;
  std::vector<int32_t> image_shape;  // (1, C, S, S)
  std::vector<std::string> class_names;
  Preprocessing input;  // the manifest's input section: resize policy, mean and std (preprocess.h)
  Graph single;                      // dense / monolithic
  Graph router;
  Graph trunk_tail;                          // expert-paths with early routing; empty name otherwise
  std::vector<Graph> shared;                 // per-block: one per MoE block
  Graph head;                                // per-block
  std::vector<std::vector<Graph>> experts;   // expert -> its graphs (one, or one per block)
  std::vector<Graph> all;                    // every graph the manifest lists (all are checksummed)
  const Graph& first() const { return kind == Kind::Split ? router : single; }
  int64_t expert_bytes(int e) const;
};

std::string shape_text(const std::vector<int32_t>& shape);

void validate(const json::Value& manifest, Bundle& bundle);

// Graph files verified before (sha256 and structure), remembered in the packed-weight cache folder by what they
// were then: the sha256 the manifest gave, with the file's device, inode, size, modification and status-change times.
// A file still all of that is not read again: an app's cold start pays for hashing the bundle once, not at every
// launch. Any write to a file changes its status-change time (the kernel sets it; no call sets it back), so a file
// damaged or replaced since is hashed again. Kept in one small file, replaced whole by each process: written as a
// staged file (staged_files.h), then renamed over it.
constexpr const char* kVerifiedFilesName = "verified-files.txt";

class VerifiedFiles {
 public:
  explicit VerifiedFiles(const std::string& dir);
  bool known(const File& file) const { return !path_.empty() && known_.count(identity(file)) > 0; }
  void remember(const File& file);
  // Write what is known now. Best effort: where the list cannot be replaced (a full disk, a directory in its place),
  // the staged file goes, the log says why, and the next open verifies the files again.
  void save() const;

  // Where the name of a file in the folder is one of save()'s staged files: where its ".tmp-" starts; else npos.
  static size_t staged_at(const std::string& name);

 private:
  static constexpr uint64_t kMaxBytes = 16u << 20;
  static constexpr size_t kMaxEntries = 100000;
  std::string path_;
  std::set<std::string> known_;
  std::vector<std::string> added_;

  static std::string identity(const File& file);
};

// `memo_dir`: the packed-weight cache folder, where files verified before are remembered (VerifiedFiles); "": none.
void verify_graph_files(Bundle& bundle, const std::string& memo_dir = "");

Bundle read_bundle(const std::string& path, const std::string& memo_dir = "");

}  // namespace mobile_moe::library
