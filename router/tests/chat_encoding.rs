//! The router's V4 chat encoding against DeepSeek's reference encoder: every fixture
//! request (tools/golden/chat/generate.py) must give the reference's prompt text and,
//! tokenised with the real V4 tokenizer, its token ids.

use std::io::Read;
use std::path::Path;

use router::chat::convert::plan;
use router::chat::request::ChatRequest;
use serde::Deserialize;
use serde_json::value::RawValue;

/// One fixture; the request stays raw text so its key order reaches the encoder.
#[derive(Deserialize)]
struct Case {
    name: String,
    request: Box<RawValue>,
    prompt: String,
    ids: Vec<u32>,
}

#[derive(Deserialize)]
struct Fixtures {
    cases: Vec<Case>,
}

#[test]
fn prompts_and_token_ids_match_the_reference_encoder() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden");
    let text = std::fs::read_to_string(dir.join("chat_encoding.json")).unwrap();
    let fixtures: Fixtures = serde_json::from_str(&text).unwrap();
    let mut json = String::new();
    flate2::read::GzDecoder::new(std::fs::File::open(dir.join("deepseek-v4-tokenizer.json.gz")).unwrap())
        .read_to_string(&mut json)
        .unwrap();
    let tok: tokenizers::Tokenizer = json.parse().unwrap();
    let cases = &fixtures.cases;
    assert!(cases.len() >= 15, "at least 15 conversations");
    let mut failed = Vec::new();
    for case in cases {
        let name = &case.name;
        let request: ChatRequest = serde_json::from_str(case.request.get()).unwrap_or_else(|e| panic!("{name}: {e}"));
        let prompt = plan(request).unwrap_or_else(|e| panic!("{name}: {e}")).conversation.render();
        let want = case.prompt.as_str();
        if prompt != want {
            let at = prompt.bytes().zip(want.bytes()).position(|(a, b)| a != b).unwrap_or(prompt.len().min(want.len()));
            let from = at.saturating_sub(60);
            failed.push(format!(
                "{name}: prompts differ at byte {at}\n  got:  {:?}\n  want: {:?}",
                String::from_utf8_lossy(&prompt.as_bytes()[from..(at + 60).min(prompt.len())]),
                String::from_utf8_lossy(&want.as_bytes()[from..(at + 60).min(want.len())])
            ));
            continue;
        }
        let ids = tok.encode(prompt.as_str(), false).unwrap().get_ids().to_vec();
        if ids != case.ids {
            failed.push(format!("{name}: token ids differ"));
        }
    }
    assert!(failed.is_empty(), "{} of {} cases differ:\n{}", failed.len(), cases.len(), failed.join("\n"));
}
