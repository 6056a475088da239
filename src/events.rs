//! `airlock events` and `airlock webhook`: a tenant's lifecycle events and webhooks, through
//! the API with its key.

use crate::client::Client;
use crate::print_json;
use clap::Subcommand;
use serde_json::{json, Value};
use std::io::BufRead;

#[derive(clap::Args)]
pub struct EventsArgs {
    /// Only this sandbox's events.
    #[arg(long)]
    sandbox: Option<String>,
    /// At most this many, newest first.
    #[arg(long, default_value_t = 50)]
    limit: u32,
    /// Keep printing events as they happen (oldest first, from now on).
    #[arg(long, short)]
    follow: bool,
}

#[derive(Subcommand)]
pub enum WebhookCommand {
    /// Register a webhook; prints it with its signing secret, shown this once.
    Create {
        url: String,
        /// An event type it gets (repeatable: `--event sandbox.created --event sandbox.killed`);
        /// none: every type.
        #[arg(long = "event")]
        events: Vec<String>,
        #[arg(long, default_value = "")]
        name: String,
    },
    /// List the tenant's webhooks, each with its last delivery's status.
    Ls,
    /// A webhook's delivery attempts, newest first.
    Deliveries {
        id: String,
    },
    /// Turn a webhook's deliveries off or on again.
    Disable {
        id: String,
    },
    Enable {
        id: String,
    },
    Rm {
        id: String,
    },
}

fn line(e: &Value) -> String {
    format!(
        "{:<8} {:<26} {:<20} {:<22} {}",
        e["seq"],
        e["at"].as_str().unwrap_or(""),
        e["type"].as_str().unwrap_or(""),
        e["sandbox_id"].as_str().unwrap_or(""),
        e["data"]
    )
}

pub fn events(c: &Client, args: EventsArgs) -> anyhow::Result<()> {
    let filter = args
        .sandbox
        .as_deref()
        .map_or(String::new(), |s| format!("sandbox_id={s}"));
    if args.follow {
        let r = c.stream_get(&format!("/v1/events/stream?{filter}"))?;
        for l in std::io::BufReader::new(r.into_reader()).lines() {
            if let Some(data) = l?.strip_prefix("data:") {
                let e: Value = serde_json::from_str(data.trim())?;
                println!("{}", line(&e));
            }
        }
        return Ok(());
    }
    let page = c.json("GET", &format!("/v1/events?limit={}&{filter}", args.limit), None)?;
    println!("{:<8} {:<26} {:<20} {:<22} DATA", "SEQ", "AT", "TYPE", "SANDBOX");
    for e in page["events"].as_array().into_iter().flatten() {
        println!("{}", line(e));
    }
    Ok(())
}

pub fn webhooks(c: &Client, command: WebhookCommand) -> anyhow::Result<()> {
    let out = match command {
        WebhookCommand::Create { url, events, name } => c.json(
            "POST",
            "/v1/webhooks",
            Some(json!({"url": url, "events": events, "name": name})),
        )?,
        WebhookCommand::Ls => c.json("GET", "/v1/webhooks", None)?,
        WebhookCommand::Deliveries { id } => c.json("GET", &format!("/v1/webhooks/{id}/deliveries"), None)?,
        WebhookCommand::Disable { id } => {
            c.json("PATCH", &format!("/v1/webhooks/{id}"), Some(json!({"enabled": false})))?
        }
        WebhookCommand::Enable { id } => {
            c.json("PATCH", &format!("/v1/webhooks/{id}"), Some(json!({"enabled": true})))?
        }
        WebhookCommand::Rm { id } => {
            c.json("DELETE", &format!("/v1/webhooks/{id}"), None)?;
            eprintln!("deleted {id}");
            return Ok(());
        }
    };
    print_json(&out);
    Ok(())
}
