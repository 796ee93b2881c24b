// Staged files: what a process writes beside a file it then publishes by rename, under a name that says who wrote it,
// so that the next process to use the folder can remove what a failed or killed one left (SIGKILL runs no clean-up)
// and nothing else. Part of libmobile_moe.
//
// A staged name is <target>.tmp-<pid>-<n>@<host>, n a hexadecimal count in the process (two handles may stage one
// target at once), host this machine's short name (runners on several machines may share a cache folder in a home on
// NFS, and must neither collide nor take each other's live files for a dead runner's). More may follow the host after
// a dot (".check", ".scratch", ".copy"). Older versions wrote no count (<key>.xnnpack.tmp-<pid>@<host>) or no host
// (verified-files.txt.tmp-<pid>-<n>): a name without "@<host>" was staged on this host.
#pragma once

#include <cstddef>
#include <functional>
#include <string>

namespace mobile_moe::library {

// A new staged name for `target`, this process's own.
std::string staged_name(const std::string& target);

// What staged_name adds, at its longest (a pid of 10 digits, the most a pid_t prints): a path checked with it fits
// whichever process stages it.
std::string longest_staged_suffix();

// Write `text` as the whole of a new file `path` (mode 0644): "" when it is written and closed, else why not (a full
// disk: "No space left on device"), and then no file is left. Through write(2), never a mapping: a full disk is an
// error here, not a signal.
std::string write_file(const std::string& path, const std::string& text);

// Remove the staged files in `dir` whose names `ours` recognises (it returns where ".tmp-" starts, or npos) and whose
// writers are gone. Best effort: a file that cannot be removed now is tried again by the next sweep.
void remove_files_left(const std::string& dir, const std::function<size_t(const std::string&)>& ours);

}  // namespace mobile_moe::library
