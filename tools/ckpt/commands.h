// The commands of ckpt, one file per group (cmd_*.cc), and the tool's entry
// point.
#pragma once

#include "common.h"

namespace ckptfs::cli {

extern const Command kInitCommand;     // cmd_init.cc
extern const Command kImportCommand;   // cmd_import.cc
extern const Command kLsCommand;       // cmd_inspect.cc
extern const Command kShowCommand;
extern const Command kDuCommand;
extern const Command kDiffCommand;
extern const Command kCatCommand;      // cmd_read.cc
extern const Command kExportCommand;
extern const Command kVerifyCommand;   // cmd_maintenance.cc
extern const Command kReindexCommand;
extern const Command kRmCommand;
extern const Command kGcCommand;
extern const Command kMountCommand;    // cmd_mount.cc
extern const Command kCopyCommand;     // cmd_copy.cc
extern const Command kDrainCommand;    // cmd_tiers.cc

// Runs `ckpt ARGS...` and returns its exit status (run.cc).
int Main(int argc, char** argv);

}  // namespace ckptfs::cli
