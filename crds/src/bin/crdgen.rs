//! Writes the KVRoutePool CRD: `crdgen` prints it, `crdgen PATH` writes it to PATH
//! (the committed copy is `crds/kvroutepool.yaml`).

use std::process::ExitCode;

fn main() -> ExitCode {
    let yaml = match kvroute_crds::crd_yaml() {
        Ok(y) => y,
        Err(e) => {
            eprintln!("crdgen: cannot render the CRD: {e}");
            return ExitCode::FAILURE;
        }
    };
    match std::env::args_os().nth(1) {
        None => {
            print!("{yaml}");
            ExitCode::SUCCESS
        }
        Some(path) => match std::fs::write(&path, yaml) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("crdgen: cannot write {}: {e}", path.to_string_lossy());
                ExitCode::FAILURE
            }
        },
    }
}
