// TensorBoard's side of the tab: the plugin library's messages, and what a same-origin iframe can read.
//
// TensorBoard (2.x) talks to a plugin's iframe over a MessageChannel the iframe opens by posting
// "experimental.bootstrap" to its parent; the messages are JSON {type, id, payload, error, isReply}.
// The host broadcasts "experimental.DataReloaded" after each of its reloads (the reload button and
// the auto-reload timer) and "experimental.RunsChanged" (the run names) when runs come or go; it
// answers "experimental.GetURLPluginData" with the URL's `p.<plugin>.<key>` entries. This is the
// plugin library TensorBoard ships for dynamic plugins (tensorboard/components/experimental/plugin_lib),
// spoken here directly: no build step.
//
// TensorBoard 2.21 shows no run selector beside an iframed plugin, and the library gives the run names,
// not the selector's choice (that lives in the Angular app's store, gone from the page while this tab
// shows): the tab follows the run list, and has its own filter. Standing alone (plugin_entry.html
// opened directly) there is no host: then nothing here is called back.

const PREFIX = "experimental.";
let port = null, nextId = 0;
const waiting = new Map(), handlers = new Map();

export function connect(pluginName) {
  if (window.parent === window) return false;
  const channel = new MessageChannel();
  port = channel.port1;
  port.onmessage = (event) => receive(JSON.parse(event.data));
  window.parent.postMessage(`${PREFIX}bootstrap`, "*", [channel.port2]);
  handlers.set("pluginName", pluginName);
  return true;
}

function receive(message) {
  if (message.isReply) {
    const wait = waiting.get(message.id);
    waiting.delete(message.id);
    if (wait) (message.error ? wait.reject(new Error(message.error)) : wait.resolve(message.payload));
    return;
  }
  const handler = handlers.get(message.type);
  let payload = null;
  try { payload = handler ? handler(message.payload) : null; } catch (error) { console.error(error); }
  port.postMessage(JSON.stringify({type: message.type, id: message.id, payload: payload ?? null, error: null, isReply: true}));
}

function ask(type, payload) {
  if (!port) return Promise.resolve(null);
  const id = nextId++;
  port.postMessage(JSON.stringify({type: PREFIX + type, id, payload, error: null, isReply: false}));
  return new Promise((resolve, reject) => {
    waiting.set(id, {resolve, reject});
    setTimeout(() => { if (waiting.delete(id)) resolve(null); }, 3000);  // an older host that never answers
  });
}

// TensorBoard's reload (its button, its auto-reload): call `callback` after each.
export function onDataReloaded(callback) { handlers.set(`${PREFIX}DataReloaded`, () => { callback(); }); }
// Runs that came or went: call `callback` with the run names TensorBoard now knows.
export function onRunsChanged(callback) { handlers.set(`${PREFIX}RunsChanged`, (names) => { callback(names); }); }
export const getRuns = () => ask("GetRuns");
// The URL's `p.<plugin>.<key>` entries, by key. TensorBoard answers GetURLPluginData from its hash dictionary,
// which 2.21 fills only as its own code writes to it (a pasted link's entries are not in it): then the
// parent's address is read, which a same-origin iframe can.
export async function getURLData(pluginName) {
  const answered = await ask("GetURLPluginData");
  if (answered && Object.keys(answered).length) return answered;
  let hash;
  try { hash = window.parent !== window ? window.parent.location.hash : ""; } catch (error) { return null; }
  const lead = `p.${pluginName}.`, found = {};
  for (const part of hash.replace(/^#/, "").split("&")) {
    const cut = part.indexOf("="), key = decodeURIComponent(cut < 0 ? part : part.slice(0, cut));
    const value = cut < 0 ? "" : decodeURIComponent(part.slice(cut + 1));
    if (key.startsWith(lead)) found[key.slice(lead.length)] = value;
  }
  return found;
}

// The view in TensorBoard's own URL (`#<tab>&p.<plugin>.<key>=<value>`), so that a link reproduces it;
// standing alone, in the page's own query.
// A key is written when it has a value or had one (then emptied): a key never used stays out of the URL.
const written = new Set();
export function writeURL(pluginName, values) {
  try {
    const storage = window.parent !== window && window.parent.tensorboard && window.parent.tensorboard.tf_storage;
    if (storage && storage.setString) {
      for (const [key, value] of Object.entries(values)) {
        const name = `p.${pluginName}.${key}`;
        if (!value && !written.has(key) && !window.parent.location.hash.includes(`${name}=`)) continue;
        storage.setString(name, value || "", {useLocationReplace: true});
        written.add(key);
      }
      return;
    }
  } catch (error) { /* another origin or version: the page's own URL below */ }
  const params = new URLSearchParams(window.location.search);
  for (const [key, value] of Object.entries(values)) { if (value) params.set(key, value); else params.delete(key); }
  history.replaceState(null, "", `${window.location.pathname}?${params}`);
}
