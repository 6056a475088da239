// sqlx::migrate!() embeds crates/server/migrations at compile time: rebuild when they change.
// The web console embeds xterm.js from console/node_modules (scripts/console-assets fetches it).
fn main() {
    println!("cargo:rerun-if-changed=migrations");
    let assets = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../console/node_modules/@xterm");
    println!("cargo:rerun-if-changed={}", assets.display());
    for file in [
        "xterm/lib/xterm.js",
        "xterm/css/xterm.css",
        "addon-fit/lib/addon-fit.js",
    ] {
        if !assets.join(file).is_file() {
            panic!(
                "the web console's assets are missing ({}): run scripts/console-assets (npm ci in console/)",
                assets.join(file).display()
            );
        }
    }
}
